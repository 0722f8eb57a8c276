"""Plans executed for real: device-aware measurement, sampled executions during campaigns, a plan
run across Dask workers, and calibration runs."""
