"""rlhf_api: the RLHFJob contract shared by the operator and the trainer (spec model, rules, validation,
CRD generation, shared constants). Imports neither rlhf_operator nor rlhf_trainer, nor kopf, the
Kubernetes client, torch or Ray.
"""
