"""rlhf-operator: reconciles RLHFJob resources into KubeRay RayClusters running the trainer."""

__version__ = "0.1.0"
