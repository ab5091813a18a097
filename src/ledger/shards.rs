//! Which shard, and which node, holds each wallet under Citus, known without asking: the rounds
//! group their wallets by node and write each node's in one transaction there (one-phase commit),
//! with one statement per shard ([`super::group`]).
//!
//! Citus places a wallet by the hash of its id, with Postgres's own hash of text (`hashtext`),
//! in the shard whose range holds that hash. [`ShardMap::load`] reads the ranges and their nodes
//! from Citus's catalog and checks its hash against Citus's own placement of a probe id: a map
//! that disagrees is not used. A map gone stale (a shard moved or split since) costs speed, never
//! correctness: a statement that names wallets of two shards is Citus's to route, and a
//! transaction that spans two nodes commits in two phases.

use super::StoreError;
use sqlx::{PgConnection, PgPool};
use std::collections::BTreeMap;
use std::num::Wrapping;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;

/// Where a statement's rows go: a shard, or (where the map does not know) the one wallet itself,
/// whose rows are on one shard whichever it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum ShardKey<'a> {
    Shard(i64),
    Wallet(&'a str),
}

/// A node of the cluster: Citus's group id of its placements.
pub type NodeId = i32;

/// Where a node takes connections: its host (or socket directory) and port, as Citus names it.
pub type NodeAddress = (String, u16);

/// The shards of `wallet` (and of every table co-located with it) and their nodes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardMap {
    /// `(lowest hash, highest hash, shard id, node)`, by lowest hash.
    shards: Vec<(i32, i32, i64, NodeId)>,
    /// The address of each active primary node.
    addresses: BTreeMap<NodeId, NodeAddress>,
    /// For each shard of `wallet`, the shard of each co-located table with its range.
    colocated: BTreeMap<i64, BTreeMap<String, i64>>,
}

/// The id whose placement [`ShardMap::load`] asks Citus for, to check its own hash against.
const PROBE: &str = "walletlock-shard-probe";

impl ShardMap {
    /// The map of the `wallet` table on the search path; `None` where it cannot be used: the table
    /// is not distributed by hash, a shard has more than one placement (replicated shards commit
    /// in two phases whatever the rounds do), or Citus placed the probe id elsewhere.
    pub async fn load(conn: &mut PgConnection) -> Result<Option<Self>, StoreError> {
        let rows: Vec<(i64, String, String, NodeId, i64)> = sqlx::query_as(
            // language=PostgreSQL
            r#"select s.shardid, s.shardminvalue, s.shardmaxvalue, p.groupid,
                      get_shard_id_for_distribution_column('wallet', $1::text)
               from pg_dist_shard s join pg_dist_placement p using (shardid)
               where s.logicalrelid = 'wallet'::regclass
                 and (select partmethod from pg_dist_partition where logicalrelid = 'wallet'::regclass) = 'h'
               order by s.shardminvalue::int4"#,
        )
        .bind(PROBE)
        .fetch_all(&mut *conn)
        .await?;
        let mut shards = Vec::with_capacity(rows.len());
        for (shard, min, max, node, _) in &rows {
            let (Ok(min), Ok(max)) = (min.parse(), max.parse()) else { return Ok(None) };
            shards.push((min, max, *shard, *node));
        }
        let addresses: Vec<(NodeId, String, i32)> = sqlx::query_as(
            // language=PostgreSQL
            "select groupid, nodename, nodeport from pg_dist_node where isactive and noderole = 'primary'",
        )
        .fetch_all(&mut *conn)
        .await?;
        let addresses = addresses
            .into_iter()
            .filter_map(|(node, host, port)| Some((node, (host, u16::try_from(port).ok()?))))
            .collect();
        let colocated_rows: Vec<(i64, String, i64)> = sqlx::query_as(
            // language=PostgreSQL
            r#"select w.shardid, s.logicalrelid::regclass::text, s.shardid
               from pg_dist_shard w join pg_dist_shard s using (shardminvalue)
               join pg_dist_partition p on p.logicalrelid = s.logicalrelid
               where w.logicalrelid = 'wallet'::regclass
                 and p.colocationid = (select colocationid from pg_dist_partition where logicalrelid = 'wallet'::regclass)"#,
        )
        .fetch_all(&mut *conn)
        .await?;
        let mut colocated: BTreeMap<i64, BTreeMap<String, i64>> = BTreeMap::new();
        for (wallet_shard, table, shard) in colocated_rows {
            colocated.entry(wallet_shard).or_default().insert(table, shard);
        }
        let map = ShardMap { shards, addresses, colocated };
        let replicated = map.shards.windows(2).any(|pair| pair[0].2 == pair[1].2);
        let probe_placed = rows.first().map(|row| row.4);
        Ok((!replicated && probe_placed.is_some() && map.shard_of(PROBE) == probe_placed).then_some(map))
    }

    /// The shard holding `wallet`, and its node.
    pub fn place(&self, wallet: &str) -> Option<(i64, NodeId)> {
        let hash = hash_text(wallet);
        let at = self.shards.partition_point(|&(min, _, _, _)| min <= hash).checked_sub(1)?;
        let (_, max, shard, node) = self.shards[at];
        (hash <= max).then_some((shard, node))
    }

    /// The node holding `wallet`.
    pub fn node(&self, wallet: &str) -> Option<NodeId> {
        self.place(wallet).map(|(_, node)| node)
    }

    /// The name of `table`'s shard co-located with `wallet_shard`: `<table>_<shard id>`.
    pub fn shard_table(&self, wallet_shard: i64, table: &str) -> Option<String> {
        Some(format!("{table}_{}", self.colocated.get(&wallet_shard)?.get(table)?))
    }

    /// Where `node` takes connections.
    pub fn address(&self, node: NodeId) -> Option<&NodeAddress> {
        self.addresses.get(&node)
    }

    /// The one node holding every wallet of `wallets`, if the map places them all there.
    pub fn node_of_all<'a>(&self, mut wallets: impl Iterator<Item = &'a str>) -> Option<NodeId> {
        let node = self.node(wallets.next()?)?;
        wallets.all(|wallet| self.node(wallet) == Some(node)).then_some(node)
    }

    fn shard_of(&self, wallet: &str) -> Option<i64> {
        self.place(wallet).map(|(shard, _)| shard)
    }

    /// Where `wallet`'s rows go (see [`ShardKey`]).
    pub fn key<'a>(map: Option<&Self>, wallet: &'a str) -> ShardKey<'a> {
        map.and_then(|map| map.shard_of(wallet)).map_or(ShardKey::Wallet(wallet), ShardKey::Shard)
    }
}

/// `rows` by the shard each goes to, each shard's in their order.
pub fn by_shard<'k, T>(
    rows: impl IntoIterator<Item = T>,
    key: impl Fn(&T) -> ShardKey<'k>,
) -> BTreeMap<ShardKey<'k>, Vec<T>> {
    let mut by_shard: BTreeMap<ShardKey<'k>, Vec<T>> = BTreeMap::new();
    for row in rows {
        by_shard.entry(key(&row)).or_default().push(row);
    }
    by_shard
}

/// `ids` grouped a statement each: all in one on one Postgres (no map), one a shard under Citus,
/// so that Citus routes each whole.
pub fn statements<'a>(map: Option<&ShardMap>, ids: &[&'a str]) -> Vec<Vec<&'a str>> {
    match map {
        None => vec![ids.to_vec()],
        Some(map) => by_shard(ids.iter().copied(), |id| ShardMap::key(Some(map), id)).into_values().collect(),
    }
}

/// How often a replica reads the map again: shards move when an operator rebalances, and until
/// the map follows, the wallets moved are written in two phases.
const REFRESH: Duration = Duration::from_secs(10);

/// A replica's [`ShardMap`], read again every [`REFRESH`] by a task of its own (kept while a
/// receiver lives). `None` until first read, and while it cannot be used.
pub fn keep(db: PgPool) -> watch::Receiver<Option<Arc<ShardMap>>> {
    let (map, kept) = watch::channel(None);
    tokio::spawn(async move {
        loop {
            let read = async { ShardMap::load(&mut *db.acquire().await?).await };
            match read.await {
                Ok(read) => {
                    if map.send(read.map(Arc::new)).is_err() {
                        return;
                    }
                }
                Err(err) => {
                    tracing::warn!(error = %err, "reading Citus's shard map failed; kept the last one")
                }
            }
            tokio::select! {
                () = tokio::time::sleep(REFRESH) => {}
                () = map.closed() => return,
            }
        }
    });
    kept
}

/// Postgres's hash of a text under a deterministic collation (`hashtext`): Bob Jenkins's lookup3
/// hash of its bytes, read as little-endian words, seeded with their length plus 3923095, as
/// Postgres seeds it. Citus hashes a text distribution column with it.
pub fn hash_text(text: &str) -> i32 {
    let bytes = text.as_bytes();
    let seed = Wrapping(0x9e37_79b9_u32) + Wrapping(bytes.len() as u32) + Wrapping(3_923_095);
    let (mut a, mut b, mut c) = (seed, seed, seed);
    let word = |four: &[u8]| Wrapping(u32::from_le_bytes(four.try_into().expect("four bytes")));
    let mut blocks = bytes.chunks_exact(12);
    for block in &mut blocks {
        a += word(&block[0..4]);
        b += word(&block[4..8]);
        c += word(&block[8..12]);
        mix(&mut a, &mut b, &mut c);
    }
    // The last 0 to 11 bytes go into a and b as they come, and into c above its lowest byte.
    let mut last = [0u8; 12];
    last[..blocks.remainder().len()].copy_from_slice(blocks.remainder());
    a += word(&last[0..4]);
    b += word(&last[4..8]);
    c += word(&last[8..12]) << 8;
    finish(&mut a, &mut b, &mut c);
    c.0 as i32
}

type Word = Wrapping<u32>;

fn rot(x: Word, k: u32) -> Word {
    Wrapping(x.0.rotate_left(k))
}

/// lookup3's `mix`: stirs each block into the state.
fn mix(a: &mut Word, b: &mut Word, c: &mut Word) {
    *a -= *c;
    *a ^= rot(*c, 4);
    *c += *b;
    *b -= *a;
    *b ^= rot(*a, 6);
    *a += *c;
    *c -= *b;
    *c ^= rot(*b, 8);
    *b += *a;
    *a -= *c;
    *a ^= rot(*c, 16);
    *c += *b;
    *b -= *a;
    *b ^= rot(*a, 19);
    *a += *c;
    *c -= *b;
    *c ^= rot(*b, 4);
    *b += *a;
}

/// lookup3's `final`: mixes the state into `c`.
fn finish(a: &mut Word, b: &mut Word, c: &mut Word) {
    *c ^= *b;
    *c -= rot(*b, 14);
    *a ^= *c;
    *a -= rot(*c, 11);
    *b ^= *a;
    *b -= rot(*a, 25);
    *c ^= *b;
    *c -= rot(*b, 16);
    *a ^= *c;
    *a -= rot(*c, 4);
    *b ^= *a;
    *b -= rot(*a, 14);
    *c ^= *b;
    *c -= rot(*b, 24);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `select hashtext(s)` on Postgres 15 (x86-64), for lengths on each side of lookup3's
    /// 12-byte blocks.
    #[test]
    fn the_hash_is_postgres_hashtext() {
        for (text, hashed) in [
            ("", -1_477_818_771),
            ("a", 1_075_015_857),
            ("w1", -2_118_909_538),
            ("abcdefghijk", -1_483_803_693),
            ("abcdefghijkl", -1_586_087_212),
            ("abcdefghijklm", 405_849_808),
            ("wallet-000123", 488_927_159),
            ("0b6c1f3e-8d2a-4c55-9a71-3f2e9d8c7b6a", -1_033_846_036),
            ("Zz_-09AbCdEfGhIjKlMnOpQrStUvWxYz0123456789-_ZZZZZZZZZZZZZZZZZZZZZ", -503_144_024),
        ] {
            assert_eq!(hash_text(text), hashed, "hashtext({text:?})");
        }
    }

    fn two_shards() -> ShardMap {
        ShardMap {
            shards: vec![(i32::MIN, -1, 10, 1), (0, i32::MAX, 11, 2)],
            addresses: BTreeMap::new(),
            colocated: BTreeMap::new(),
        }
    }

    #[test]
    fn a_wallet_is_in_the_shard_whose_range_holds_its_hash() {
        let map = two_shards();
        // hashtext('w1') < 0, hashtext('a') > 0.
        assert_eq!(map.place("w1"), Some((10, 1)));
        assert_eq!(map.place("a"), Some((11, 2)));
        assert_eq!(ShardMap::key(Some(&map), "a"), ShardKey::Shard(11));
        assert_eq!(ShardMap::key(None, "a"), ShardKey::Wallet("a"));
    }

    #[test]
    fn ids_go_a_statement_a_shard_under_citus_and_all_in_one_without_a_map() {
        let map = two_shards();
        // hashtext('w1') < 0 (shard 10), hashtext('a') > 0 (shard 11).
        assert_eq!(statements(Some(&map), &["a", "w1", "a"]), [vec!["w1"], vec!["a", "a"]]);
        assert_eq!(statements(None, &["a", "w1"]), [vec!["a", "w1"]]);
    }

    #[test]
    fn wallets_have_one_node_only_when_the_map_places_each_there() {
        let map = two_shards();
        // hashtext('w1') < 0 (node 1), hashtext('a') > 0 (node 2).
        assert_eq!(map.node_of_all(["a", "a"].into_iter()), Some(2));
        assert_eq!(map.node_of_all(["w1"].into_iter()), Some(1));
        assert_eq!(map.node_of_all(["a", "w1"].into_iter()), None);
        assert_eq!(map.node_of_all(std::iter::empty()), None);
    }

    #[test]
    fn a_hash_in_no_range_has_no_shard() {
        let gap = ShardMap {
            shards: vec![(i32::MIN, -2_130_000_000, 10, 1), (0, i32::MAX, 11, 2)],
            addresses: BTreeMap::new(),
            colocated: BTreeMap::new(),
        };
        assert_eq!(gap.place("w1"), None, "hashtext('w1') falls between the ranges");
        assert_eq!(ShardMap::key(Some(&gap), "w1"), ShardKey::Wallet("w1"));
    }
}
