"""The scheduler: jobs, the generation service that owns the model's lanes, the KV memory budget
and the prefix bank. No HTTP and no Ray: it runs and tests in-process."""
