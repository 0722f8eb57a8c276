"""A campaign's life on the driver: config, run / resume / status, the farm loop, Dask clients,
live progress and export."""
