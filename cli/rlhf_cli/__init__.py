"""rlhf_cli: the `rlhf` command, on top of every other package. It routes each subcommand to the package
that owns it (rlhf_api for `crd` and `validate`, the operator and the trainer by module name when
chosen), so neither of those imports the other and `rlhf validate` never imports torch, Ray or kopf.
"""
