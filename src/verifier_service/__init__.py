"""The verifier service: owns the target model and verifies draft blocks."""
