"""Training a DFlash drafter for a target: prompts -> the target's own answers (prompts, data) -> the
block-parallel training forward and loss (model) -> the resumable training loop (trainer) -> the
`python -m ddtree train` command line (cli)."""
