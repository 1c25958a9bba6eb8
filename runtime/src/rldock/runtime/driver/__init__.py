"""The driver process: the job's inputs, one attempt's workers, the loop with its records and
checkpoints, the feed and the iteration schedules. Nothing here runs in a Ray worker."""
