"""Ways into the partitioner besides ``partitioner.partition``: ``dynamo``, the ``torch.compile`` backend."""
