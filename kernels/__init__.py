"""The compiler: hardware and model catalogs, engine configuration, performance model, engine scheduler, config search. Imports nothing else of Polymorph."""
