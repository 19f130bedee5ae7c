"""The model backends the model stage runs (`backends.py`, named in `config/model_backends.py`) and a
tensor-parallel replica's other ranks (`followers.py`); imports none of its modules."""
