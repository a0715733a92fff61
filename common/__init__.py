"""What the server, the metaserver and the client share.

Imports nothing else of pegaflow, so every part may import it: the client must
never import server code, and the two daemons should not import each other.
"""
