"""Adapters that run environments of public libraries in the agent loop (``rollers.agent_loop``).

Each adapter is one module that implements ``rollers.environment``'s interface and imports its library only when
its environment is checked or built, so the module imports without it and the library stays an optional extra;
``rollers.environments`` registers it by name: ``gem`` (``rollers.env_adapters.gem``,
``pip install 'hflow-async[gem]'``).
"""
