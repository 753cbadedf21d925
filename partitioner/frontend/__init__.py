"""The way in: tracing to aten (``trace``), value specialisation for data-dependent sizes
(``value_specialization``), bucketed input sizes (``padding``), and the ``torch.compile`` backend (``dynamo``)."""
