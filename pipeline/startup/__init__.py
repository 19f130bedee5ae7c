"""Driver-side start-up of a run: the sink and its index read before Ray starts (`nothing_to_do.py`), actor
placement and failed starts (`placement.py`), nodes lost mid-run (`node_loss.py`); imports none of its modules."""
