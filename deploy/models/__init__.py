"""The models on this machine: `tandem pull` downloads one from the Hugging
Face Hub (pull_cmd.py), `tandem list` and `tandem rm` show and delete the
downloaded ones (models_cmd.py). Where models live and which files they need:
environment/hub_cache.py; the download: environment/hub_pull.py.

And the models `tandem serve` runs: the supervisor's slots (slots.py, one
model's workers each), the router's control socket (control.py), the child
processes' record and stopping (children.py); `tandem ps` and `tandem stop`
against the running server (loaded_cmd.py)."""
