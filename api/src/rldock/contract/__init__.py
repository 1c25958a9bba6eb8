"""The runtime <-> operator contract: everything both programs must agree on, in one place.

The operator image has no runtime (no torch, Ray or vLLM), and the runtime never imports the
operator, so what they share lives here, on the ground floor beside the job config:

- `progress`: the progress line the trainer prints and the operator parses from the job log;
- `checkpoints`: where checkpoints go and how they are named (the operator reports them);
- `algorithms`: the algorithm catalogue (which algorithms run a critic), which the config checks
  use and the runtime's recipes must match;
- `tensor_parallel`: the divisibility rule for a tensor-parallel size, checked by the config and
  applied by the runtime;
- `layout`, `placement`: the job's shape (ranks, generation replicas, device groups, devices) and
  which worker sits on which device, read by the config checks, the runtime and the planner;
- `runtime_cli`: the runtime's command line as the operator submits it;
- `version`: the release, which names the default runtime image.
"""
