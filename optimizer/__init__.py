"""The search farm and the ``tapestry`` command line, in four subpackages by concern:

- ``optimizer.search``: the search core that runs anywhere: Pareto tools (``pareto``), mutation
  operators (``mutation``), hand-built baselines (``baselines``), the Dask search tasks
  (``worker``) and the strategies that plan them (``strategies``);
- ``optimizer.campaign``: a campaign's life on the driver: config (``config``), run / resume /
  status (``lifecycle``), the farm loop (``farm``), Dask clients (``cluster``), live progress
  (``progress``) and ``export``;
- ``optimizer.realrun``: plans executed for real: device-aware measurement (``measurement``),
  sampled executions in campaigns (``sampling``), a plan across Dask workers (``grid``) and
  calibration runs (``calibration``);
- ``optimizer.cli``: the ``tapestry`` commands.

Imports point one way: ``cli`` -> ``campaign`` -> ``realrun`` -> ``search``; nothing in
``search`` imports the others.
"""
