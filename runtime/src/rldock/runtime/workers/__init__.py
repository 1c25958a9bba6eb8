"""Ray actors, one class per GRPO worker state; each reads and writes samples only via the dock."""
