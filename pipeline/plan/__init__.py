"""The one plan (`spec.py`: `RunPlan`, its `StageSpec`s) and the one preflight (`preflight.py`); imports none
of its modules."""
