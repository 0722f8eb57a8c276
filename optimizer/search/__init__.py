"""The search core: Pareto tools, mutation operators, baselines, Dask search tasks, strategies.

Nothing here touches the database or the cluster; tasks take and return plain, typed data.
"""
