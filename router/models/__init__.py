"""The models the router serves: which are loaded, loading one on demand,
unloading idle ones (protos/model_messages.py is the supervisor's side)."""
