"""Recovery after a death or an eviction: the plan, the reform of the group, the procedure."""
