"""An ETL job on object storage: read parquet from S3, answer with an LLM, write parquet back.

Runs against any S3-compatible store through fsspec/s3fs. Give the input and output URLs
and the storage options (JSON) of your bucket::

    python examples/object_storage_etl.py s3://bucket/questions/ s3://bucket/answers/ \\
        --storage-options '{"anon": false}'

Without URLs it starts a local S3-compatible server (moto, ``pip install "moto[server]"``)
on 127.0.0.1, uploads a small table and runs the same job against it, so the example runs
as it stands. The write is resumable: run it again with ``--resume`` after a crash and
only the missing partitions are computed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import socket

import dask.dataframe as dd
import pandas as pd
from distributed import Client, LocalCluster

import dfllm

QUESTIONS = [
    "What is the boiling point of water at sea level?",
    "Name three primary colours.",
    "What does a CPU do?",
    "Why is the sky blue?",
    "What is parquet?",
    "Who wrote Hamlet?",
]


@contextlib.contextmanager
def local_bucket():
    """A moto S3 server on 127.0.0.1 with a bucket holding the sample questions."""
    import boto3
    from moto.server import ThreadedMotoServer

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # the server's per-request log lines
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    boto3.client(
        "s3", endpoint_url=endpoint, aws_access_key_id="demo", aws_secret_access_key="demo", region_name="us-east-1"
    ).create_bucket(Bucket="etl-demo")
    options = {"key": "demo", "secret": "demo", "client_kwargs": {"endpoint_url": endpoint}}
    sample = pd.DataFrame({"question_id": range(len(QUESTIONS)), "question": QUESTIONS})
    dd.from_pandas(sample, npartitions=3).to_parquet("s3://etl-demo/questions/", storage_options=options)
    try:
        yield "s3://etl-demo/questions/", "s3://etl-demo/answers/", options
    finally:
        server.stop()


def run(source: str, target: str, options: dict, resume: bool, max_tokens: int) -> None:
    with LocalCluster(n_workers=1, threads_per_worker=4, dashboard_address=":0") as cluster, Client(cluster):
        questions = dd.read_parquet(source, storage_options=options)
        answers = questions.llm.chat(
            "{question}",
            system="Answer in one short sentence.",
            sampling_params={"temperature": 0.0, "max_tokens": max_tokens},
        )
        summary = dfllm.write_parquet(answers, target, storage_options=options, resume=resume)
    print(summary)
    result = pd.read_parquet(target, storage_options=options).sort_values("question_id")
    for row in result.head(3).itertuples():
        print(f"- {row.question}\n  {str(row.generated_text).strip()}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", nargs="?")
    parser.add_argument("target", nargs="?")
    parser.add_argument("--storage-options", type=json.loads, default={})
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--max-tokens", type=int, default=48)
    args = parser.parse_args()
    if args.source and args.target:
        run(args.source, args.target, args.storage_options, args.resume, args.max_tokens)
    else:
        with local_bucket() as (source, target, options):
            run(source, target, options, args.resume, args.max_tokens)


if __name__ == "__main__":
    main()
