"""pegaflow-metaserver: the approximate global index of which node holds which KV blocks.

``python -m pegaflow.metaserver`` (or the ``pegaflow-metaserver`` script) runs it;
``pegaflow.metaserver.client.MetaClient`` talks to it.
"""
