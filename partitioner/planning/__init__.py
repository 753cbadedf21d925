"""Choosing and reading a deployment: the layout search (``planner``), the physical step-time model and its device
profiles (``cost``, ``calibrate``, ``profiles/``), what a partition costs a rank (``report``), the plan as a
picture (``plan_view``) and the pass-by-pass dumps (``dump``)."""
