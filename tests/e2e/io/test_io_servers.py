"""The io stage's servers are the real thing: moto's S3 server speaks S3 over HTTP with authentication on
(a wrong key is refused, a multipart upload completes) and the MLflow server keeps what a client logs."""

from __future__ import annotations

import pytest
from botocore.exceptions import ClientError
from testkit.mlflow_server import MlflowServer
from testkit.object_store import ObjectStore

pytestmark = pytest.mark.io


def test_s3_server_refuses_a_wrong_key_and_completes_a_multipart_upload(object_store: ObjectStore) -> None:
    bucket = object_store.bucket("io-servers")
    with pytest.raises(ClientError, match="SignatureDoesNotMatch"):
        object_store.client(aws_secret_access_key="wrong").list_objects_v2(Bucket=bucket)
    client = object_store.client()
    upload = client.create_multipart_upload(Bucket=bucket, Key="big")
    parts = [b"a" * (5 * 1024 * 1024), b"b" * 10]  # S3's smallest part (5 MiB), then a last short one
    etags = [
        client.upload_part(Bucket=bucket, Key="big", UploadId=upload["UploadId"], PartNumber=n, Body=body)[
            "ETag"
        ]
        for n, body in enumerate(parts, start=1)
    ]
    client.complete_multipart_upload(
        Bucket=bucket,
        Key="big",
        UploadId=upload["UploadId"],
        MultipartUpload={"Parts": [{"ETag": e, "PartNumber": n} for n, e in enumerate(etags, start=1)]},
    )
    assert client.get_object(Bucket=bucket, Key="big")["Body"].read() == b"".join(parts)


def test_mlflow_server_keeps_a_runs_metrics_and_params(mlflow_server: MlflowServer) -> None:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=mlflow_server.url)
    experiment = client.create_experiment("io-servers")
    run = client.create_run(experiment).info.run_id
    client.log_param(run, "kl_coef", "0.01")
    for step, value in enumerate([0.5, 0.25]):
        client.log_metric(run, "reward_mean", value, step=step)
    client.set_terminated(run)
    again = MlflowClient(tracking_uri=mlflow_server.url)  # a second client: read from the server's store
    assert [(m.step, m.value) for m in again.get_metric_history(run, "reward_mean")] == [(0, 0.5), (1, 0.25)]
    assert again.get_run(run).data.params == {"kl_coef": "0.01"}
