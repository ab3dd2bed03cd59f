"""Stage 1 (and the FX helpers every stage uses): the graph Dynamo captured, made into the graph the passes match.

* :mod:`.canonicalize` -- stage 1: Dynamo's graph re-traced to a pre-dispatch ATen graph with FakeTensor metadata,
  the form every pattern is traced in; the bodies of activation-checkpointed regions walked too.
* :mod:`.emit` -- stage 3: the rewritten graph made a valid module again, the fuse result recorded, tensor
  constants lifted to trailing inputs for the downstream backend.
* :mod:`.utils` -- FX helpers shared by the stages and the families: source lines, pattern tracing with the same
  normalisation as the graphs, checkpoint walks.

This package imports nothing of the fusion stage (tests/test_layers.py holds the layering).
"""
