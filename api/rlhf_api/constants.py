"""Names both sides of the RLHFJob contract must agree on, beyond the spec: the Ray custom resources a
RayCluster's worker pods advertise (the operator writes them, the trainer places its groups on them).
Constants only: no imports, no logic.
"""

from __future__ import annotations

from typing import Final

# The trainer image of a job that names none, when the operator is not told another (the chart passes
# jobDefaults.trainerImage as RLHF_DEFAULT_TRAINER_IMAGE); its tag follows the project's version.
DEFAULT_TRAINER_IMAGE: Final = "ghcr.io/rlhf-operator/trainer:0.1.0"
# Advertised by the trainer worker group's pods (rayStartParams.resources); the driver places model ranks on them.
TRAINER_RESOURCE: Final = "rlhf_trainer_slot"
# Advertised by the rollout worker group's pods; the engine pool counts them to size itself.
ROLLOUT_RESOURCE: Final = "rlhf_rollout_slot"
# Set ("1") by the operator on the driver of a job in its own RayCluster, whose worker pods advertise the
# two resources above: the driver's placement groups then always ask for them, so a trainer rank never
# lands on a rollout pod (or an engine on a trainer pod) while the pods are still joining a new head
# (after the head pod's loss they rejoin one by one). Unset under the development head override, whose
# local Ray head advertises neither.
POD_SLOTS_ENV: Final = "RLHF_POD_SLOTS"
# The trainer driver's exit status for bad input it found at run time (a model path that does not exist,
# a reward function that does not import, a checkpoint of another run): the operator fails the job with
# the driver's `error:` line and does not restart it, since every attempt would fail the same way.
INPUT_ERROR_EXIT_CODE: Final = 2
# The driver's exit when told to stop (SIGTERM: preemption, suspension) after its last checkpoint: 128 + 15,
# as a process killed by SIGTERM. Never 0: a stopped run has not finished.
PREEMPTED_EXIT_CODE: Final = 143
# The margin the pods keep for their own shutdown out of runPolicy.terminationGracePeriodSeconds.
SHUTDOWN_MARGIN_SECONDS: Final = 10
# Env var carrying the trainer's stop budget in seconds (grace period less the margin).
STOP_BUDGET_ENV: Final = "RLHF_STOP_BUDGET_SECONDS"
# The named CPU stand-in for GPUs advertised but not real: the operator passes it (chart value
# jobDefaults.gpuStandIn) to each job's driver, which reads it (rlhf_trainer.device.for_job).
GPU_STANDIN_ENV: Final = "RLHF_GPU_STANDIN"
# A stall's stack snapshot (docs/monitoring.md): the snapshot job's last log line starts with this and
# carries the snapshot as JSON (the operator reads it back); each process gets this long to answer.
STACKS_LOG_MARKER: Final = "RLHF_STACKS "
STACK_PROCESS_LIMIT_SECONDS: Final = 5
# The keys of the Secret named by spec.storage.s3.credentialsSecret, each given to every container of the
# job (and so to its driver and Ray workers) as the environment variable of the same name, which boto3
# and pyarrow read natively. The first two are required; the others optional (docs/data.md).
S3_CREDENTIAL_KEYS: Final = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")
S3_OPTIONAL_KEYS: Final = ("AWS_ENDPOINT_URL", "AWS_REGION", "AWS_SESSION_TOKEN")
