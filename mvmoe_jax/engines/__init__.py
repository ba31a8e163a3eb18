"""The fast paths: faster forms of the reference computation, each turned on by fields of the execution plan
(``mvmoe_jax.execution.ExecutionPlan``). Each module's docstring names the reference function it replaces,
the plan fields that choose it, and why it is faster; docs/performance.md gives the measurements.
"""
