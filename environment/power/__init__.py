"""The machine's power and thermal state, and the serving policy it calls for.

`state.py`: what one reading says; `readers.py` (and the platform modules it
picks): how it is read, never raising, every call bounded in time;
`policy.py`: which policy a state calls for and what that policy changes.
Nothing here imports MLX: the router, the supervisor and the workers use it.
"""
