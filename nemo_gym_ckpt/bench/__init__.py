"""The benchmark suites of ``nemo-gym-ckpt bench`` (the top floor: the only room that imports ``model_servers``)."""
