"""Job code around the engine: ``build_processor`` pipelines, input sources, cluster
connection and the ``dfllm`` command line."""
