//! The wallets spread over a Citus cluster (docs/operating/citus.md): a coordinator and two workers
//! of the test's own, every table distributed by wallet. A payment is one transaction on the
//! worker holding its wallet; a worker or the coordinator dying under load loses no acknowledged
//! payment and applies none twice; a worker lost mid-round fails only its own wallets' items of a
//! batch over both; a worker added under load takes its share of the wallets while they keep
//! being paid.

use crate::batches::{balance, paid, pay, request_id_served_by, settle_batch};
use crate::group::{first_writes, payment, wallet_with};
use crate::support::fleet::{Fleet, audit_books};
use crate::support::load::{Load, check_books, open_wallets, settle, tally, time_to_recover};
use crate::support::servers::{CitusCluster, RemoteCommand};
use crate::support::transfers::{self, TransferLoad};
use crate::support::{TestEnv, eventually};
use serde_json::{Value, json};
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::{Duration, Instant};
use walletlock::ledger::Entry;
use walletlock::ledger::group::{self, GroupWrite, HoldsToRead, ReadOutcome, ToRead};
use walletlock::ledger::shards::ShardMap;
use walletlock::ledger::storage::{KnownStorage, Storage, Workers};
use walletlock::wallet::WalletId;

const WALLETS: [&str; 8] = ["c1", "c2", "c3", "c4", "c5", "c6", "c7", "c8"];
/// More wallets, for a rebalance to move some of them.
const SPREAD: [&str; 24] = [
    "r01", "r02", "r03", "r04", "r05", "r06", "r07", "r08", "r09", "r10", "r11", "r12", "r13", "r14", "r15",
    "r16", "r17", "r18", "r19", "r20", "r21", "r22", "r23", "r24",
];
const OPENING: i64 = 1_000_000;
/// A short lease and claim staleness, so wallets whose worker died are taken up again quickly.
const SETTINGS: [(&str, &str); 2] = [("LEASE_TTL", "1s"), ("IDEMPOTENCY_STALE_AFTER", "2s")];

/// A distributed transaction as the coordinator sent it (a statement sent outside a transaction
/// block counts as one): the nodes it touched, and its commands.
#[derive(Debug, Default)]
struct Transaction<'c> {
    nodes: BTreeSet<String>,
    commands: Vec<&'c str>,
}

impl Transaction<'_> {
    /// How many of `wallets` its writes of the `wallet` table name.
    fn wallets_written(&self, wallets: &[&str]) -> usize {
        let writes: Vec<&&str> = self.commands.iter().filter(|sql| sql.contains("UPDATE ")).collect();
        let named = |wallet: &&&str| {
            writes.iter().any(|sql| {
                [
                    format!("{{{wallet},"),
                    format!(",{wallet},"),
                    format!(",{wallet}}}"),
                    format!("{{{wallet}}}"),
                ]
                .iter()
                .any(|literal| sql.contains(literal))
            })
        };
        wallets.iter().filter(named).count()
    }
}

/// Each distributed transaction of `commands`, and whether any committed in two phases.
fn transactions_of(commands: &HashMap<u32, Vec<RemoteCommand>>) -> (Vec<Transaction<'_>>, bool) {
    let mut done = Vec::new();
    let mut two_phase = false;
    for issued in commands.values() {
        // The transaction open on this backend: its distributed id, itself, and whether it is
        // committing (its COMMITs go out one per node).
        let mut open: Option<(String, Transaction, bool)> = None;
        for command in issued {
            let sql = command.sql.as_str();
            two_phase |= sql.starts_with("PREPARE TRANSACTION") || sql.starts_with("COMMIT PREPARED");
            if let Some(id) = sql.split("assign_distributed_transaction_id(").nth(1) {
                let id = id.split(", '").next().unwrap_or_default().to_owned();
                if open.as_ref().is_none_or(|(current, _, _)| *current != id) {
                    done.extend(open.take().map(|(_, transaction, _)| transaction));
                    open = Some((id, Transaction::default(), false));
                }
                open.as_mut().expect("opened").1.nodes.insert(command.node.clone());
            } else if let Some((_, transaction, committing)) =
                open.as_mut().filter(|(_, _, committing)| !committing)
            {
                transaction.nodes.insert(command.node.clone());
                transaction.commands.push(sql);
                *committing =
                    ["COMMIT", "ROLLBACK", "PREPARE TRANSACTION"].iter().any(|end| sql.starts_with(end));
            } else if let Some((_, transaction, _)) =
                open.as_mut().filter(|_| sql.starts_with("COMMIT") || sql.starts_with("ROLLBACK"))
            {
                transaction.nodes.insert(command.node.clone());
            } else {
                done.extend(open.take().map(|(_, transaction, _)| transaction));
                done.push(Transaction { nodes: BTreeSet::from([command.node.clone()]), commands: vec![sql] });
            }
        }
        done.extend(open.map(|(_, transaction, _)| transaction));
    }
    (done, two_phase)
}

/// `wallets` by the worker holding each, as `host:port` (a worker's host is its socket
/// directory), in their order.
async fn wallets_by_worker(
    db: &sqlx::PgPool,
    wallets: &[&'static str],
) -> HashMap<String, Vec<&'static str>> {
    let mut by_worker: HashMap<String, Vec<&'static str>> = HashMap::new();
    for &wallet in wallets {
        let worker: String = sqlx::query_scalar(
            "select nodename || ':' || nodeport from pg_dist_shard_placement
             where shardid = get_shard_id_for_distribution_column('wallet', $1)",
        )
        .bind(wallet)
        .fetch_one(db)
        .await
        .expect("the wallet's placement");
        by_worker.entry(worker).or_default().push(wallet);
    }
    by_worker
}

/// A wallet on each of the two workers.
async fn one_wallet_on_each_worker(db: &sqlx::PgPool) -> [&'static str; 2] {
    let by_worker = wallets_by_worker(db, &WALLETS).await;
    let mut firsts = by_worker.values().map(|wallets| wallets[0]);
    [firsts.next().expect("a worker"), firsts.next().expect("wallets on both workers")]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn under_citus_each_payment_is_one_transaction_on_the_worker_holding_its_wallet() {
    let citus = tokio::task::block_in_place(CitusCluster::start);
    let env = TestEnv::with_citus(&citus);
    let fleet = Fleet::start(&env, 2, &SETTINGS).await;
    let distributed: Vec<(String, String)> = sqlx::query_as(
        "select logicalrelid::regclass::text, column_to_column_name(logicalrelid, partkey)
         from pg_dist_partition
         where colocationid = (select colocationid from pg_dist_partition where logicalrelid = 'wallet'::regclass)
         order by 1",
    )
    .fetch_all(&fleet.db)
    .await
    .unwrap();
    let by_table: Vec<(&str, &str)> = distributed.iter().map(|(t, c)| (t.as_str(), c.as_str())).collect();
    assert_eq!(
        by_table,
        [
            ("entry_rollup", "wallet_id"),
            ("entry_rollup_until", "wallet_id"),
            ("event", "wallet_id"),
            ("hold", "wallet_id"),
            ("idempotency_key", "wallet_id"),
            ("ledger_entry", "wallet_id"),
            ("movement", "wallet_id"),
            ("transfer", "from_wallet"),
            ("wallet", "id")
        ],
        "every table is distributed by wallet, co-located with the wallets"
    );
    open_wallets(&fleet, &WALLETS, OPENING).await;

    let mut attempts = Vec::new();
    let commands = citus
        .remote_commands(|| async {
            let load = Load::start(&fleet, &WALLETS, 8);
            eventually("payments", Duration::from_secs(30), || async { load.acknowledged() >= 200 }).await;
            attempts = load.finish().await;
        })
        .await;
    // A round of one worker's wallets is written on a connection straight to that worker, on its
    // shards' tables; only a round the replica's map cannot place yet goes through the
    // coordinator, as one transaction on one worker too.
    let (transactions, two_phase) = transactions_of(&commands);
    let routed: usize = transactions.iter().map(|t| t.wallets_written(&WALLETS)).sum();
    let spread: Vec<&BTreeSet<String>> =
        transactions.iter().map(|t| &t.nodes).filter(|nodes| nodes.len() > 1).collect();
    assert!(spread.is_empty(), "transactions on more than one node: {spread:?}");
    assert!(!two_phase, "a payment committed in two phases");
    // A round writes several wallets, and a wallet several payments: with 8 clients, at most 8 at a
    // time, 200 payments acknowledged are at least 25 wallet writes, each counted by its worker.
    let written_on = |worker: usize| {
        // Citus hides the shards' tables from a session's catalog unless asked not to.
        let url = citus.workers[worker].url("postgres");
        let separator = if url.contains('?') { '&' } else { '?' };
        let url = format!("{url}{separator}options[citus.override_table_visibility]=off");
        async move {
            let db = sqlx::PgPool::connect(&url).await.expect("a worker");
            let written: i64 = sqlx::query_scalar(
                "select coalesce(sum(n_tup_upd), 0)::int8 from pg_stat_user_tables where relname ~ '^wallet_[0-9]+$'",
            )
            .fetch_one(&db)
            .await
            .expect("the worker's table statistics");
            written
        }
    };
    eventually("the workers' counts of their wallet writes", Duration::from_secs(30), || async {
        // A backend reports its counts when idle, within seconds.
        let (first, second) = (written_on(0).await, written_on(1).await);
        first > 0 && second > 0 && (first + second) as usize >= 25 + routed
    })
    .await;

    // A wallet's reads go to its worker alone, one command each, not one per shard: the wallet
    // with its available balance, and its history (its ledger, its balance as of an instant, a
    // statement).
    let instant = |at: chrono::DateTime<chrono::Utc>| at.to_rfc3339_opts(chrono::SecondsFormat::Micros, true);
    let now = chrono::Utc::now();
    let (hour_ago, now) = (instant(now - chrono::TimeDelta::hours(1)), instant(now));
    let history = [
        "transactions".to_owned(),
        format!("entries?from={hour_ago}&to={now}&kind=pay,deposit&order=desc"),
        format!("balance?at={now}"),
        format!("statement?from={hour_ago}&to={now}"),
    ];
    let reads = citus
        .remote_commands(|| async {
            for wallet in WALLETS {
                let paths = history.iter().map(|read| format!("/wallets/{wallet}/{read}"));
                for path in paths.chain([format!("/wallets/{wallet}")]) {
                    let response = fleet.client.get(fleet.url(&path)).send().await.unwrap();
                    assert_eq!(response.status(), 200, "GET {path}");
                }
            }
        })
        .await;
    // Every request reads the wallet (the history's, for its owner); each of the history's reads
    // the ledger, in one command, and a wallet's first statement reads it once more, to roll its
    // past hours up (src/ledger/history.rs).
    let wallet_reads = (history.len() + 1) * WALLETS.len();
    let history_reads = history.len() * WALLETS.len() + WALLETS.len();
    for (table, reads_of_table) in [("wallet", wallet_reads), ("ledger_entry", history_reads)] {
        // A shard of `table` is `<schema>.<table>_<shard id>` (not a column such as `h.wallet_id`).
        let shard = format!(".{table}_");
        let reads_shard = |sql: &str| {
            sql.match_indices(&shard)
                .any(|(at, _)| sql[at + shard.len()..].starts_with(|c: char| c.is_ascii_digit()))
        };
        let sent: Vec<&RemoteCommand> = reads
            .values()
            .flatten()
            .filter(|command| command.sql.starts_with("SELECT") && reads_shard(&command.sql))
            .collect();
        assert_eq!(
            sent.len(),
            reads_of_table,
            "{reads_of_table} reads of `{table}` sent {}: {sent:?}",
            sent.len()
        );
    }

    // The check above sees a transaction that spans two workers: two wallets on different workers
    // written in one transaction are exactly that, committed in two phases.
    let pair = one_wallet_on_each_worker(&fleet.db).await;
    let across = citus
        .remote_commands(|| async {
            let mut tx = fleet.db.begin().await.unwrap();
            for wallet in pair {
                sqlx::query("update wallet set updated_at = now() where id = $1")
                    .bind(wallet)
                    .execute(&mut *tx)
                    .await
                    .unwrap();
            }
            tx.commit().await.unwrap();
        })
        .await;
    let (across, two_phase) = transactions_of(&across);
    assert!(two_phase && across.iter().any(|t| t.nodes.len() == 2), "{across:?}");

    settle(&fleet, &mut attempts).await;
    let opening: Vec<(&str, i64)> = WALLETS.iter().map(|w| (*w, OPENING)).collect();
    check_books(&fleet, &opening, &attempts).await;
}

/// A replica's rounds group the wallets of one worker (src/wallet/rounds/group.rs): the map of
/// shards it keeps places every wallet where Citus does, and a round of several wallets on several
/// shards of one worker is read one statement a shard, and written in one transaction on that
/// worker alone, one statement a shard for each table, without two-phase commit.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn under_citus_a_round_of_one_workers_wallets_commits_there_in_one_phase_a_statement_a_shard() {
    let citus = tokio::task::block_in_place(CitusCluster::start);
    let env = TestEnv::with_citus(&citus);
    let (schema, db) = env.database(3).await;
    let mut conn = db.acquire().await.unwrap();
    let map = ShardMap::load(&mut conn).await.unwrap().expect("the wallets' shards");
    // Wallets, until one worker holds some on two shards.
    let mut by_node: HashMap<i32, Vec<(WalletId, i64)>> = HashMap::new();
    let two_shards = |wallets: &Vec<(WalletId, i64)>| wallets.iter().any(|(_, shard)| *shard != wallets[0].1);
    for _ in 0..200 {
        let id = wallet_with(&db, 100).await;
        let (shard, node): (i64, i32) = sqlx::query_as(
            "select s, (select groupid from pg_dist_placement where shardid = s)
             from get_shard_id_for_distribution_column('wallet', $1::text) s",
        )
        .bind(id.as_str())
        .fetch_one(&mut *conn)
        .await
        .unwrap();
        assert_eq!(map.place(id.as_str()), Some((shard, node)), "{id} is where Citus placed it");
        let of_node = by_node.entry(node).or_default();
        of_node.push((id, shard));
        if of_node.len() >= 8 && two_shards(of_node) {
            break;
        }
    }
    let round = by_node.into_values().find(two_shards).expect("a worker with wallets on two shards");
    let shards: BTreeSet<i64> = round.iter().map(|(_, shard)| *shard).collect();
    let round: Vec<WalletId> = round.into_iter().map(|(id, _)| id).collect();

    let reads: Vec<ToRead> =
        round.iter().map(|id| ToRead { id: id.as_str(), fence: 5, written: false }).collect();
    let names: Vec<&str> = round.iter().map(WalletId::as_str).collect();
    let entries: Vec<Entry> = round.iter().map(|id| payment(id, 5, 2, 10, 90)).collect();
    let write = GroupWrite { entries: entries.iter().collect(), ..GroupWrite::of(first_writes(&round, 5)) };
    let (conn, map, write, names, reads) = (&mut conn, &map, &write, &names, &reads);
    let commands = citus
        .remote_commands(|| async move {
            let found = group::read(conn, Some(map), reads, names, &[], HoldsToRead::none()).await.unwrap();
            for name in names {
                assert!(matches!(found.wallets[*name], ReadOutcome::Ready { .. }), "{name}: {found:?}");
            }
            // Through the coordinator: without connections of its own to the workers.
            let now = chrono::Utc::now();
            let committed =
                group::commit(conn, Storage::Citus, Some(map), None, write, now, Duration::from_secs(60))
                    .await
                    .unwrap();
            assert_eq!(committed.moved.len(), names.len(), "{committed:?}");
        })
        .await;
    let (transactions, two_phase) = transactions_of(&commands);
    assert!(!two_phase, "the round committed in two phases");
    let of_table = |t: &Transaction, table: &str| {
        let shard = format!("{}.{table}_", schema.name());
        t.commands.iter().filter(|sql| sql.contains(&shard)).count()
    };
    let (writes, reads): (Vec<&Transaction>, Vec<&Transaction>) =
        transactions.iter().filter(|t| of_table(t, "wallet") > 0).partition(|t| t.wallets_written(names) > 0);
    assert_eq!(reads.len(), shards.len(), "one read a shard: {reads:?}");
    assert_eq!(writes.len(), 1, "one transaction writes the round: {writes:?}");
    assert_eq!(writes[0].nodes.len(), 1, "on one worker: {:?}", writes[0].nodes);
    assert_eq!(writes[0].wallets_written(names), names.len());
    for table in ["wallet", "ledger_entry"] {
        assert_eq!(of_table(writes[0], table), shards.len(), "a statement a shard writes `{table}`");
    }
    let balances: Vec<i64> = sqlx::query_scalar("select balance from wallet where id = any($1)")
        .bind(names)
        .fetch_all(&db)
        .await
        .unwrap();
    assert_eq!(balances, vec![90; names.len()]);

    // With connections to the workers, as a replica's rounds have: the next payment of each is
    // written on that worker alone, and the coordinator sends it nothing.
    let known = KnownStorage::default();
    let workers = known.workers(&db);
    let commands = pay_ten_each(&citus, &db, map, workers, &round, 2, 90).await;
    assert!(commands.values().all(Vec::is_empty), "the coordinator sent {commands:?}");

    // A schema whose round cannot check its shards on the worker (migrated by an earlier release)
    // is written through the coordinator instead.
    sqlx::query("drop function walletlock_shards_here").execute(&db).await.unwrap();
    let commands = pay_ten_each(&citus, &db, map, workers, &round, 3, 80).await;
    let (transactions, two_phase) = transactions_of(&commands);
    assert!(
        !two_phase && transactions.iter().any(|t| t.wallets_written(names) == names.len()),
        "{transactions:?}"
    );
}

/// A round written on its worker's shard tables holds Citus's lock on their metadata
/// (src/ledger/group.rs, `Routed::on_worker`): a shard move waits for it, so the round's write is
/// on the shard the move copies; and a round placed by a map read before the move finds its shard
/// gone and is written through the coordinator, on the shard's new worker.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn under_citus_a_shard_move_waits_for_a_round_on_its_worker_and_a_later_round_follows_the_shard() {
    let citus = tokio::task::block_in_place(CitusCluster::start);
    let env = TestEnv::with_citus(&citus);
    let (_schema, db) = env.database(4).await;
    let map = ShardMap::load(&mut db.acquire().await.unwrap()).await.unwrap().expect("the wallets' shards");
    let id = wallet_with(&db, 100).await;
    let (shard, node) = map.place(id.as_str()).expect("the wallet's shard");
    let node_named = |group: i32| {
        let db = db.clone();
        async move {
            let (host, port): (String, i32) =
                sqlx::query_as("select nodename, nodeport from pg_dist_node where groupid = $1")
                    .bind(group)
                    .fetch_one(&db)
                    .await
                    .unwrap();
            (host, port)
        }
    };
    let (from_host, from_port) = node_named(node).await;
    let other: i32 =
        sqlx::query_scalar("select groupid from pg_dist_node where groupid not in (0, $1) limit 1")
            .bind(node)
            .fetch_one(&db)
            .await
            .unwrap();
    let (to_host, to_port) = node_named(other).await;

    // A round on the wallet's worker, as a replica writes it: the check, then the write.
    let known = KnownStorage::default();
    let workers = known.workers(&db);
    let mut round = workers.pool(map.address(node).expect("the worker's address")).begin().await.unwrap();
    let here: bool = sqlx::query_scalar("select walletlock_shards_here($1, $2)")
        .bind(vec![shard])
        .bind(node)
        .fetch_one(&mut *round)
        .await
        .unwrap();
    assert!(here, "the shard is on its worker");
    let mover = tokio::spawn({
        let db = db.clone();
        async move {
            sqlx::query(
                "select citus_move_shard_placement($1, $2, $3, $4, $5, shard_transfer_mode => 'block_writes')",
            )
            .bind(shard)
            .bind(from_host)
            .bind(from_port)
            .bind(to_host)
            .bind(to_port)
            .execute(&db)
            .await
            .expect("the shard moved")
        }
    });
    // The move waits for the round's lock on the shard's metadata, on the round's worker.
    let worker = workers.pool(map.address(node).expect("the worker's address"));
    eventually("the move waiting for the round", Duration::from_secs(20), || async {
        let waiting: i64 = sqlx::query_scalar(
            "select count(*) from pg_stat_activity where wait_event_type = 'Lock' and query like '%lock_shard_metadata%'",
        )
        .fetch_one(&worker)
        .await
        .unwrap();
        waiting > 0
    })
    .await;
    let table = map.shard_table(shard, "wallet").expect("the wallet shard's table");
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "update {table} set balance = 90, version = 2, fence = 5 where id = $1"
    )))
    .bind(id.as_str())
    .execute(&mut *round)
    .await
    .unwrap();
    assert!(!mover.is_finished(), "the move went on while the round held its shard");
    round.commit().await.unwrap();
    tokio::time::timeout(Duration::from_secs(60), mover).await.expect("the move ended").unwrap();
    let placed: i32 = sqlx::query_scalar(
        "select groupid from pg_dist_placement where shardid = get_shard_id_for_distribution_column('wallet', $1::text)",
    )
    .bind(id.as_str())
    .fetch_one(&db)
    .await
    .unwrap();
    assert_eq!(placed, other, "the shard moved");
    let balance: i64 = sqlx::query_scalar("select balance from wallet where id = $1")
        .bind(id.as_str())
        .fetch_one(&db)
        .await
        .unwrap();
    assert_eq!(balance, 90, "the round's write moved with its shard");

    // The map read before the move still places the wallet on its first worker: the round finds
    // its shard gone there, and goes through the coordinator.
    let commands = pay_ten_each(&citus, &db, &map, workers, std::slice::from_ref(&id), 2, 90).await;
    let (transactions, _) = transactions_of(&commands);
    assert!(transactions.iter().any(|t| t.wallets_written(&[id.as_str()]) == 1), "{transactions:?}");
}

/// Pays 10 from each wallet of `round` (fence 5, at `version` and `balance`) in one round with the
/// replica's connections to the workers, checks each paid, and returns what the coordinator sent
/// its workers meanwhile.
async fn pay_ten_each(
    citus: &CitusCluster,
    db: &sqlx::PgPool,
    map: &ShardMap,
    workers: &Workers,
    round: &[WalletId],
    version: i64,
    balance: i64,
) -> HashMap<u32, Vec<RemoteCommand>> {
    let entries: Vec<Entry> = round.iter().map(|id| payment(id, 5, version + 1, 10, balance - 10)).collect();
    let mut wallets = first_writes(round, 5);
    for wallet in &mut wallets {
        (wallet.read_fence, wallet.read_version, wallet.read_balance) = (5, version, balance);
        (wallet.version, wallet.balance) = (version + 1, balance - 10);
    }
    let write = GroupWrite { entries: entries.iter().collect(), ..GroupWrite::of(wallets) };
    let mut conn = db.acquire().await.unwrap();
    let (conn, write) = (&mut conn, &write);
    let commands = citus
        .remote_commands(|| async move {
            let now = chrono::Utc::now();
            let committed = group::commit(
                conn,
                Storage::Citus,
                Some(map),
                Some(workers),
                write,
                now,
                Duration::from_secs(60),
            )
            .await
            .unwrap();
            assert_eq!(committed.moved.len(), round.len(), "{committed:?}");
        })
        .await;
    let names: Vec<&str> = round.iter().map(WalletId::as_str).collect();
    let balances: Vec<i64> = sqlx::query_scalar("select balance from wallet where id = any($1)")
        .bind(&names)
        .fetch_all(db)
        .await
        .unwrap();
    assert_eq!(balances, vec![balance - 10; round.len()]);
    commands
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn under_citus_a_worker_and_then_the_coordinator_killed_under_load_lose_no_payment() {
    let mut citus = tokio::task::block_in_place(CitusCluster::start);
    let env = TestEnv::with_citus(&citus);
    let fleet = Fleet::start(&env, 3, &SETTINGS).await;
    open_wallets(&fleet, &WALLETS, OPENING).await;
    let first_worker = CitusCluster::node(&citus.workers[0]);
    let by_worker = wallets_by_worker(&fleet.db, &WALLETS).await;
    let on_first_worker = by_worker
        .get(&first_worker)
        .unwrap_or_else(|| panic!("no wallet on the first worker, {first_worker}"))[0];
    let load = Load::start(&fleet, &WALLETS, 8);
    let mut attempts = Vec::new();

    for node in ["a worker", "the coordinator"] {
        let seen = load.acknowledged();
        eventually("payments", Duration::from_secs(30), || async { load.acknowledged() >= seen + 100 }).await;
        let server = if node == "a worker" { &mut citus.workers[0] } else { &mut citus.coordinator };
        let killed_at = Instant::now();
        tokio::task::block_in_place(|| {
            server.crash();
            server.start_again();
        });
        let restarted = killed_at.elapsed();
        let resumed = time_to_recover(&fleet, on_first_worker, Duration::from_secs(20), &mut attempts).await;
        println!("{node}: restarted in {restarted:?}, its wallets paid again {resumed:?} after");
        assert!(resumed <= Duration::from_secs(15), "payments resumed {resumed:?} after {node} came back");
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    attempts.extend(load.finish().await);
    println!("{:?}", tally(&attempts));
    settle(&fleet, &mut attempts).await;
    let opening: Vec<(&str, i64)> = WALLETS.iter().map(|w| (*w, OPENING)).collect();
    check_books(&fleet, &opening, &attempts).await;
}

/// A crash can land anywhere in a transfer between the workers: in the COPY that inserts its
/// legs, in its PREPARE, or between PREPARE and COMMIT PREPARED, after which the restarted worker
/// holds the transfer's rows in a prepared transaction until the coordinator's recovery commits it
/// (`citus.recover_2pc_interval`, deploy/citus.sh). Four crashes, two of each worker: every answer
/// is one the API gives (a lost node is a 503, never a 500), transfers go on within seconds of
/// each restart, and the books balance.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn under_citus_transfers_between_workers_commit_whole_through_each_worker_killed_twice_under_load() {
    let mut citus = tokio::task::block_in_place(CitusCluster::start);
    let env = TestEnv::with_citus(&citus);
    let fleet = Fleet::start(&env, 3, &SETTINGS).await;
    // The first two wallets (between which a third of the clients transfer back and forth) on
    // different workers; the others wherever they hash.
    let pair = one_wallet_on_each_worker(&fleet.db).await;
    let wallets: Vec<&str> =
        pair.into_iter().chain(WALLETS.into_iter().filter(|w| !pair.contains(w))).collect();
    open_wallets(&fleet, &wallets, OPENING).await;

    let load = TransferLoad::start(&fleet, &wallets, 8);
    eventually("transfers before the kill", Duration::from_secs(30), || async {
        sqlx::query_scalar::<_, i64>("select count(*) from transfer").fetch_one(&fleet.db).await.unwrap()
            >= 50
    })
    .await;
    let transfers_made = || async {
        sqlx::query_scalar::<_, i64>("select count(*) from transfer").fetch_one(&fleet.db).await.unwrap()
    };
    for crash in 0..4 {
        let worker = &mut citus.workers[crash % 2];
        tokio::task::block_in_place(|| {
            worker.crash();
            worker.start_again();
        });
        let before = transfers_made().await;
        eventually("transfers after the restart", Duration::from_secs(15), || async {
            transfers_made().await >= before + 30
        })
        .await;
    }
    let mut attempts = load.finish().await;
    println!("{:?}", transfers::tally(&attempts));
    transfers::settle(&fleet, &mut attempts).await;

    // Transfers between the workers went through: each was a transaction on both, committed in two
    // phases, and is both legs or nothing.
    let pairs: Vec<(String, String)> =
        sqlx::query_as("select from_wallet, to_wallet from transfer").fetch_all(&fleet.db).await.unwrap();
    let by_worker = wallets_by_worker(&fleet.db, &WALLETS).await;
    let worker_of: HashMap<&str, &String> = by_worker
        .iter()
        .flat_map(|(worker, wallets)| wallets.iter().map(move |wallet| (*wallet, worker)))
        .collect();
    let across = pairs.iter().filter(|(from, to)| worker_of[from.as_str()] != worker_of[to.as_str()]).count();
    assert!(across >= 20, "{across} of {} transfers between the two workers", pairs.len());
    let opening: Vec<(&str, i64)> = wallets.iter().map(|w| (*w, OPENING)).collect();
    transfers::check_books(&fleet, &opening, &attempts).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn under_citus_a_worker_added_under_load_takes_its_share_of_the_wallets_and_loses_no_payment() {
    // 8 shards per table, not 32: each shard group's move takes seconds, whatever its size.
    let mut citus = tokio::task::block_in_place(|| CitusCluster::start_with(&["citus.shard_count=8"]));
    let env = TestEnv::with_citus(&citus);
    let fleet = Fleet::start(&env, 3, &SETTINGS).await;
    // Enough wallets that about a third of them land on the new worker.
    open_wallets(&fleet, &SPREAD, OPENING).await;
    let load = Load::start(&fleet, &SPREAD, 8);
    eventually("payments", Duration::from_secs(30), || async { load.acknowledged() >= 100 }).await;

    let third = tokio::task::block_in_place(|| citus.add_worker());
    // The shards move while the wallets in them are paid: each is copied and kept up to date by
    // logical replication, and writes to it wait only for the moment it changes hands.
    let started = Instant::now();
    let admin = sqlx::PgPool::connect(&citus.url()).await.expect("the coordinator");
    sqlx::query("select citus_rebalance_start()").execute(&admin).await.expect("citus_rebalance_start");
    tokio::time::timeout(
        Duration::from_secs(120),
        sqlx::query("select citus_rebalance_wait()").execute(&admin),
    )
    .await
    .expect("the rebalance finished within 2 minutes")
    .expect("citus_rebalance_wait");
    let moved = started.elapsed();
    let status: String =
        sqlx::query_scalar("select state::text from citus_rebalance_status() order by job_id desc limit 1")
            .fetch_one(&admin)
            .await
            .expect("citus_rebalance_status");
    assert_eq!(status, "finished", "the rebalance job");
    let rebalanced_at: chrono::DateTime<chrono::Utc> =
        sqlx::query_scalar("select now()").fetch_one(&admin).await.unwrap();

    let by_worker = wallets_by_worker(&fleet.db, &SPREAD).await;
    let shards: i64 = sqlx::query_scalar(
        "select count(*) from pg_dist_shard_placement where nodename || ':' || nodeport = $1",
    )
    .bind(&third)
    .fetch_one(&admin)
    .await
    .unwrap();
    assert!(shards > 0, "no shard moved to the new worker");
    let on_third = by_worker.get(&third).cloned().unwrap_or_default();
    assert!(!on_third.is_empty(), "none of {} wallets moved to the new worker: {by_worker:?}", SPREAD.len());
    println!("rebalanced in {moved:?}: {shards} shards on the new worker, with wallets {on_third:?}");

    // The wallets keep being paid where they now live.
    let seen = load.acknowledged();
    eventually("payments after the rebalance", Duration::from_secs(30), || async {
        load.acknowledged() >= seen + 100
    })
    .await;
    let mut attempts = load.finish().await;
    settle(&fleet, &mut attempts).await;
    let slowest = attempts.iter().map(|attempt| attempt.took).max().unwrap_or_default();
    println!("{:?}; the slowest payment took {slowest:?}", tally(&attempts));
    let opening: Vec<(&str, i64)> = SPREAD.iter().map(|w| (*w, OPENING)).collect();
    check_books(&fleet, &opening, &attempts).await;
    let paid_there: i64 = sqlx::query_scalar(
        "select count(*) from ledger_entry where wallet_id = any($1) and kind = 'pay' and created_at > $2",
    )
    .bind(&on_third)
    .bind(rebalanced_at)
    .fetch_one(&fleet.db)
    .await
    .unwrap();
    assert!(paid_there > 0, "no payment of {on_third:?} on the new worker after the rebalance");
}

/// A batch over both workers' wallets, whose replica stops itself before its first round's commit
/// while one worker is SIGKILLed: a round is the wallets of one worker, so the lost worker fails
/// only its own wallets' items, each a 503 (`dependency_unavailable`, or `outcome_unknown` where a
/// commit was in flight), never a 500, and the other worker's items are applied. While that worker
/// stays down, the batch sent again replays the live worker's items and refuses the lost one's,
/// applying nothing; once it is back, the batch retried whole charges every item exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn under_citus_a_batch_over_both_workers_with_one_killed_mid_round_fails_only_that_workers_items() {
    let mut citus = tokio::task::block_in_place(CitusCluster::start);
    let env = TestEnv::with_citus(&citus);
    // Leases that outlast the replica's stop, so that the round it stopped in commits or fails
    // for its worker alone, not for a lease lost meanwhile.
    let mut fleet = Fleet::start(&env, 3, &[("LEASE_TTL", "10s"), ("IDEMPOTENCY_STALE_AFTER", "2s")]).await;
    open_wallets(&fleet, &SPREAD, OPENING).await;
    let lost_worker = CitusCluster::node(&citus.workers[0]);
    let by_worker = wallets_by_worker(&fleet.db, &SPREAD).await;
    let lost: Vec<&str> = by_worker.get(&lost_worker).cloned().unwrap_or_default();
    assert!(!lost.is_empty() && lost.len() < SPREAD.len(), "wallets on both workers: {by_worker:?}");
    // 10 payments on each wallet, in turns, the lost worker's first (so the first round, the one
    // that stops, is most likely its own); amounts that tell each wallet's payments apart.
    let wallets: Vec<&str> =
        lost.iter().copied().chain(SPREAD.iter().copied().filter(|w| !lost.contains(w))).collect();
    let items: Vec<Value> = (0..10 * wallets.len())
        .map(|n| pay(wallets[n % wallets.len()], 1 + (n / wallets.len()) as i64, &format!("both-{n}")))
        .collect();
    let on_lost = |item: &Value| lost.contains(&item["wallet_id"].as_str().unwrap());

    fleet.replicas[0].set_env("WALLETLOCK_FAILPOINT", Some("before_commit:stop"));
    fleet.replicas[0].start();
    let request_id = request_id_served_by(&fleet, "replica-1").await;
    let (client, url, body) = (fleet.client.clone(), fleet.url("/batches"), json!({ "items": items }));
    let mut first = tokio::spawn(async move {
        let response = client.post(url).header("x-request-id", request_id).json(&body).send().await.unwrap();
        (response.status().as_u16(), response.json::<Value>().await.unwrap_or(Value::Null))
    });
    fleet.replicas[0].stopped_at_failpoint("replica-1 stopped before a round's commit", &mut first).await;
    tokio::task::block_in_place(|| citus.workers[0].crash());
    fleet.replicas[0].signal(nix::sys::signal::Signal::SIGCONT);
    let (status, answer) = first.await.unwrap();
    assert_eq!(status, 200, "the batch is answered item by item: {answer}");
    let answers = answer["items"].as_array().expect("items").clone();
    let refused_on_lost = |answers: &[Value], replayed: bool| {
        for (item, answer) in items.iter().zip(answers) {
            if on_lost(item) {
                assert_eq!(answer["status"], 503, "{item} is on the lost worker: {answer}");
                let code = answer["body"]["code"].as_str().unwrap_or_default();
                assert!(["dependency_unavailable", "outcome_unknown"].contains(&code), "{item}: {answer}");
            } else {
                assert_eq!(answer["status"], 200, "{item} is on the live worker: {answer}");
                assert_eq!(answer["replayed"] == true, replayed, "{item}: {answer}");
            }
        }
    };
    refused_on_lost(&answers, false);
    let mut codes: BTreeMap<String, usize> = BTreeMap::new();
    for answer in &answers {
        *codes.entry(format!("{} {}", answer["status"], answer["body"]["code"])).or_default() += 1;
    }
    println!(
        "{} items, {} on the lost worker: {codes:?}",
        items.len(),
        items.iter().filter(|i| on_lost(i)).count()
    );

    // While the worker is down: the live worker's items replay, the lost one's are refused again.
    let (status, again) = crate::batches::batch(&fleet, &items).await;
    assert_eq!(status, 200, "{again}");
    refused_on_lost(again["items"].as_array().expect("items"), true);
    for wallet in SPREAD.iter().filter(|w| !lost.contains(w)) {
        let charged: i64 = (1..=10).sum();
        assert_eq!(balance(&fleet, wallet).await, (OPENING - charged, 11), "{wallet}: each payment once");
    }

    tokio::task::block_in_place(|| citus.workers[0].start_again());
    fleet.replicas[0].set_env("WALLETLOCK_FAILPOINT", None);
    fleet.replicas[0].start();
    let answers = settle_batch(&fleet, &items).await;
    let acks = paid(&SPREAD.iter().map(|w| (*w, OPENING)).collect::<Vec<_>>(), &items, &answers);
    for wallet in SPREAD {
        let charged: i64 = (1..=10).sum();
        assert_eq!(balance(&fleet, wallet).await, (OPENING - charged, 11), "{wallet}: each payment once");
    }
    audit_books(&fleet.database_url, &acks);
}
