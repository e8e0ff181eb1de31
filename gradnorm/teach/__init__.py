"""What the notebooks and figures use: toy problems, the simulations behind each notebook, views,
widgets, plots and the palette. Importing them loads no torch.distributed code; only the
launchers (``launch``, ``harness``, ``checks``) start processes."""
