"""Experiment tracking (spec.tracking): MLflow, Weights & Biases and TensorBoard sinks fed from the step
report that feeds Prometheus. Each sink runs behind its own bounded queue and thread (dispatch.py), so a
backend that is down never stops training.
"""
