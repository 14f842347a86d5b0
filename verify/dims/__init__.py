"""The parallelism dimensions of a case, and the one owner of their degrees and mesh
(`parallel_dims.ParallelDims`)."""
