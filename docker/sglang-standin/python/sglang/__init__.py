"""Stand-in for SGLang's package: the modules eaglet's image and launcher touch, nothing else."""
