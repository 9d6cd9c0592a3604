"""Reading a job: the YAML file and overrides, the user's loss tried early, the job-file reference."""
