"""The flow spec: the worker states, the dock's column groups, the recipe type, the catalogue of
recipes and a job's recipe; data that both halves read (no Ray, no workers, no driver)."""
