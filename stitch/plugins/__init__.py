"""The ground floor: the spec types plugins register, the hook specifications and the ``Registry`` view the
layers below the host look names up through. Imports nothing else of stitch."""
