"""Running a partition: the rank program's interpreter and its inputs (``program``), the drop-in module and
``parallelize`` (``module``, ``pipelines``), ranks that agree on every call (``agreement``, ``preflight``),
this rank's weights (``weights``, ``checkpoint``), ``verify``, and the collectives the programs call."""
