"""What lrdsl proves about a mixer's IR: interval ranges, the eigenvalue checker, its numeric
witnesses and the offline solve's conjugate-gradient facts."""
