"""rldock runtime: runs one RL job on Ray (dock, engines, workers, trainer loop)."""
