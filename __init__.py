"""pegaflow: an external KV-cache service for vLLM.

The repository root is this package: `pegaflow.server`, `pegaflow.client`,
`pegaflow.connector`, ... are the folders of the same names. Keep this file
free of imports: vLLM imports `pegaflow.connector` in three processes.
"""

__version__ = "0.1.0"
