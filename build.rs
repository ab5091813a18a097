//! Rebuilds the crate when a migration is added: `sqlx::migrate!` embeds `migrations/` at compile
//! time, and cargo would otherwise notice a new file there only once a Rust file changes (a
//! replica built so migrates without it).
fn main() {
    println!("cargo:rerun-if-changed=migrations");
}
