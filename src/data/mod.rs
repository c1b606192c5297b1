//! Datasets and data loading: readers for the real datasets fetched by `scripts/`.

pub mod mnist;
