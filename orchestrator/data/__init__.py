"""The data of a job as the driver sees it: the index of its files, built once before any worker starts."""
