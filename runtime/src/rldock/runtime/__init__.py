"""rldock runtime: runs one RL job on Ray (dock, engines, workers, trainer loop)."""

from rldock.runtime import tensordict_import

# Before any module of the runtime imports tensordict (rldock.runtime.tensordict_import).
tensordict_import.install()
