"""Real inference engines: one adapter per kind (sglang, vLLM, llama.cpp, emulated).

Each adapter knows how to launch its engine from a rendered ``kernels.config.EngineConfig``, how to
check those arguments with the engine's own parser where it can run, and how to read the engine's
``/metrics`` into one ``EngineLoad`` record that the router, the controller and the dashboard read
(never engine-specific metric names). Installing the CPU engines and the tiny test model is
``fleet.engines.install``'s job.
"""
