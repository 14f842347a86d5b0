"""The parallelism dimensions of a case: the one owner of their degrees and mesh
(`parallel_dims.ParallelDims`) and the one table of what is not modelled together (`together.py`)."""
