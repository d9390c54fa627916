"""The compiled-step runtime: a step (a replay of a captured graph, or this package's own code)
traced into one functional ATen graph with its state explicit (tracing), run by an executor
(the FX interpreter, the debug preset's checks, TorchInductor) on device memory as a
static-shape CompiledFunction, and written to and loaded from codegen directories."""
