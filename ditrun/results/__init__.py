"""The results directory: its files (``files.py``), the protocol by which runs share it (``rundir.py``), and the run
directories a report finds and reads (``runs.py``). Nothing here measures or runs a model."""
