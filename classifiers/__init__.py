"""Request classification: features, domain, output-length prediction and shapes."""
