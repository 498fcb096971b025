//! Tests of the look-ahead worker: flags, inserts, selection, planning, staging layout,
//! followers, cancellation.

use std::sync::{Arc, RwLock};
use std::time::Duration;

use icecache::lookahead::{
    Elem, Flush, FollowerLane, Geometry, HostBuf, Job, JobState, Lane, LaneSource, LayerBuffers, LayerJobs, LeaderLane,
    LookAhead, Outcome, Ready, Work,
};
use icecache::pages::{int8, value4, PageFormat, Stores};
use icecache::{Config, HeadForest, KeyData, Metric, ResidentPages, SelectParams};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rand_distr::StandardNormal;

const H: usize = 2;
const G: usize = 3;
const D: usize = 16;
const S: usize = 8;

fn rows(n: usize, seed: u64) -> Vec<f32> {
    let mut rng = StdRng::seed_from_u64(seed);
    (0..n * D).map(|_| rng.sample::<f32, _>(StandardNormal)).collect()
}

fn buf<T>(v: &mut [T]) -> HostBuf {
    // SAFETY: the vectors outlive the jobs in these tests, which wait for every job.
    unsafe { HostBuf::new(v.as_mut_ptr() as *mut u8, std::mem::size_of_val(v)) }
}

fn geometry() -> Geometry {
    Geometry { heads: H, query_heads: H * G, dim: D, page_size: S, elem: Elem::F32, format: PageFormat::Native }
}

/// A leader over `n` tokens per head (`[H, n, D]` keys = values), with stores of `p` pages.
struct Layer {
    forest: Arc<RwLock<HeadForest>>,
    resident: Arc<RwLock<ResidentPages>>,
    keys: Vec<f32>,
    k_store: Vec<f32>,
    v_store: Vec<f32>,
}

fn layer(n: usize, p: usize, capacity: usize) -> Layer {
    let keys = rows(H * n, 1);
    let mut cfg = Config::new(D, Metric::InnerProduct);
    cfg.seed = Some(5);
    cfg.promotion = vec![0.05, 0.2];
    let f = HeadForest::build(KeyData::F32(&keys), H, cfg, S, PageFormat::Native).unwrap();
    let mut k_store = vec![0f32; H * p * S * D];
    let mut v_store = vec![0f32; H * p * S * D];
    f.write_pages(&keys, &keys, Stores::Native(&mut k_store, &mut v_store)).unwrap();
    Layer {
        forest: Arc::new(RwLock::new(f)),
        resident: Arc::new(RwLock::new(ResidentPages::new(H, capacity).unwrap())),
        keys,
        k_store,
        v_store,
    }
}

fn leader_job(l: &mut Layer, q: &mut [f32], staging: &mut [u8], flush: Option<Flush>, width: usize) -> Job {
    Job {
        geometry: geometry(),
        ready: None,
        staging: buf(staging),
        work: Work::Leader {
            lanes: vec![LeaderLane {
                forest: Some(l.forest.clone()),
                resident: l.resident.clone(),
                k_store: buf(&mut l.k_store),
                v_store: buf(&mut l.v_store),
                flush,
            }],
            queries: buf(q),
            select: SelectParams {
                max_pages: width,
                scale: 0.25,
                effort: Some(1.0),
                exact: false,
                successors: 0,
                group_view: false,
            },
            reselect: true,
        },
        keep_alive: Box::new(()),
    }
}

struct Meta {
    load_bh: Vec<i32>,
    load_slot: Vec<i32>,
    load_len: Vec<i32>,
    clear_bh: Vec<i32>,
    table: Vec<i32>,
    table_len: Vec<i32>,
    rows_at: usize,
}

/// One follower lane's job behind `leader`'s.
fn follower_job(g: Geometry, staging: &mut [u8], lane: FollowerLane, leader: &Arc<JobState>) -> Job {
    Job {
        geometry: g,
        ready: None,
        staging: buf(staging),
        work: Work::Follower { lanes: vec![lane], leader: leader.clone() },
        keep_alive: Box::new(()),
    }
}

fn staging_bytes(g: &Geometry, batch: usize, width: usize, capacity: usize) -> usize {
    g.staging_layout(batch, width, capacity).bytes
}

/// Reads the staging layout of `Outcome` back (one sequence; `capacity` device slots per head).
fn meta(o: &Outcome, staging: &[u8], capacity: usize) -> Meta {
    let l = geometry().staging_layout(1, o.width, capacity);
    let i64s = |r: std::ops::Range<usize>| -> Vec<i64> {
        staging[r].chunks_exact(8).map(|c| i64::from_ne_bytes(c.try_into().unwrap())).collect()
    };
    let i32s = |r: std::ops::Range<usize>| -> Vec<i32> {
        staging[r].chunks_exact(4).map(|c| i32::from_ne_bytes(c.try_into().unwrap())).collect()
    };
    let (n, c) = (o.loads, o.clears);
    let loads = &i64s(l.load_idx_at..l.mask_idx_at)[..];
    let masks = &i64s(l.mask_idx_at..l.table_at)[..];
    assert_eq!((loads.len(), masks.len()), (l.max_loads, l.max_masks));
    let (table, table_len) = (i32s(l.table_at..l.table_len_at), i32s(l.table_len_at..l.mask_at));
    assert_eq!((table.len(), table_len.len()), (l.table_entries, l.table_entries));
    assert_eq!(l.table_entries, H * o.width);
    let trash = l.trash as i64;
    assert!(loads[n..].iter().chain(&masks[n + c..]).all(|&x| x == trash), "padding names the trash slot");
    assert_eq!(loads[..n], masks[..n], "the mask rows start with the loaded slots");
    let mask = &staging[l.mask_at..l.mask_at + (n + c) * S];
    let lens: Vec<i32> = mask.chunks_exact(S).map(|r| r.iter().map(|&x| x as i32).sum()).collect();
    for (row, &len) in mask.chunks_exact(S).zip(&lens) {
        assert!(row.iter().enumerate().all(|(i, &x)| (x == 1) == ((i as i32) < len)), "mask rows are prefixes");
    }
    assert!(lens[n..].iter().all(|&l| l == 0), "cleared slots hold no token");
    assert_eq!(o.end, l.rows_at + 2 * n * S * D * 4);
    let cap = capacity as i64;
    Meta {
        load_bh: loads[..n].iter().map(|&x| (x / cap) as i32).collect(),
        load_slot: loads[..n].iter().map(|&x| (x % cap) as i32).collect(),
        load_len: lens[..n].to_vec(),
        clear_bh: masks[n..n + c].iter().map(|&x| (x / cap) as i32).collect(),
        table,
        table_len,
        rows_at: l.rows_at,
    }
}

/// The staged rows of loaded page `i` are the store's page, and its length is the page's.
fn check_rows(l: &Layer, o: &Outcome, m: &Meta, staging: &[u8]) {
    let f = l.forest.read().unwrap();
    let p = l.k_store.len() / (H * S * D);
    let page_bytes = S * D * 4;
    let table_pages: Vec<i32> = m.table.clone();
    assert_eq!(m.load_bh.len(), o.loads);
    for i in 0..o.loads {
        let head = m.load_bh[i] as usize;
        // Which page went to that slot: find it in the table of this head.
        let pos =
            (0..o.width).find(|&j| table_pages[head * o.width + j] == m.load_slot[i]).expect("loaded slot in table");
        assert_eq!(m.table_len[head * o.width + pos], m.load_len[i]);
        // K then V of each loaded page: keys equal values in these tests.
        let row = &staging[m.rows_at + 2 * i * page_bytes..m.rows_at + (2 * i + 1) * page_bytes];
        let v_row = &staging[m.rows_at + (2 * i + 1) * page_bytes..m.rows_at + (2 * i + 2) * page_bytes];
        assert_eq!(row, v_row);
        let floats: Vec<f32> = row.chunks_exact(4).map(|c| f32::from_ne_bytes(c.try_into().unwrap())).collect();
        // The row equals some page of the store with that length.
        let found = (0..f.num_pages(head).unwrap()).any(|pg| {
            let at = (head * p + pg) * S * D;
            f.page_tokens(head, pg).unwrap().len() as i32 == m.load_len[i] && l.k_store[at..at + S * D] == floats[..]
        });
        assert!(found, "staged row {i} is no page of head {head}");
    }
}

/// The regions of a staging layout follow each other in order, each as large as its entries.
#[test]
fn staging_regions_are_contiguous_and_sized() {
    for format in [PageFormat::Native, PageFormat::Int8, PageFormat::K8V4] {
        let g = Geometry { format, ..geometry() };
        let (batch, width, capacity) = (3, 5, 7);
        let l = g.staging_layout(batch, width, capacity);
        let lanes = batch * H;
        assert_eq!(
            (l.max_loads, l.max_masks, l.table_entries),
            (lanes * width, lanes * (width + capacity), lanes * width)
        );
        assert_eq!(l.load_idx_at, 0);
        assert_eq!(l.mask_idx_at, l.load_idx_at + 8 * l.max_loads, "int64 load_idx");
        assert_eq!(l.table_at, l.mask_idx_at + 8 * l.max_masks, "int64 mask_idx");
        assert_eq!(l.table_len_at, l.table_at + 4 * l.table_entries, "int32 table");
        assert_eq!(l.mask_at, l.table_len_at + 4 * l.table_entries, "int32 table_len");
        assert!(l.rows_at >= l.mask_at + l.max_masks * S && l.rows_at.is_multiple_of(icecache::lookahead::ROW_ALIGN));
        assert_eq!(l.bytes, l.rows_at + l.max_loads * (g.k_page_bytes() + g.v_page_bytes()));
        assert_eq!((l.k_page_bytes, l.v_page_bytes), (g.k_page_bytes(), g.v_page_bytes()));
        assert_eq!(l.trash, lanes * capacity);
    }
}

#[test]
fn run_selects_plans_and_stages() {
    let mut l = layer(400, 120, 24);
    let g = geometry();
    let worker = LookAhead::new(Some(2)).unwrap();
    let mut q = rows(H * G, 9);
    let width = 12;
    let mut staging = vec![0u8; staging_bytes(&g, 1, width, 24)];
    let o = worker.run(leader_job(&mut l, &mut q, &mut staging, None, width)).unwrap();
    assert_eq!(o.width, width);
    assert_eq!(o.loads, o.selected, "first step loads every selected page");
    assert_eq!(o.clears, 0);
    let m = meta(&o, &staging, 24);
    check_rows(&l, &o, &m, &staging);
    // The same selection again loads nothing.
    let o2 = worker.run(leader_job(&mut l, &mut q, &mut staging, None, width)).unwrap();
    assert_eq!(o2.loads, 0);
    assert_eq!(meta(&o2, &staging, 24).table, m.table);
}

#[test]
fn everything_fits_takes_every_page() {
    let mut l = layer(60, 40, 32);
    let worker = LookAhead::new(Some(1)).unwrap();
    let mut q = rows(H * G, 2);
    let width = 32;
    let mut staging = vec![0u8; staging_bytes(&geometry(), 1, width, 32)];
    let o = worker.run(leader_job(&mut l, &mut q, &mut staging, None, width)).unwrap();
    let f = l.forest.read().unwrap();
    assert_eq!(o.selected, (0..H).map(|h| f.num_pages(h).unwrap()).sum::<usize>());
    let m = meta(&o, &staging, 32);
    let total: i32 = m.table_len.iter().sum();
    assert_eq!(total as usize, H * 60, "every token selected exactly once");
}

#[test]
fn flush_inserts_and_reloads_changed_pages() {
    let mut l = layer(300, 200, 40);
    let worker = LookAhead::new(Some(2)).unwrap();
    let mut q = rows(H * G, 4);
    let width = 40; // the pool holds every selected page
    let mut staging = vec![0u8; staging_bytes(&geometry(), 1, width, 40)];
    worker.run(leader_job(&mut l, &mut q, &mut staging, None, width)).unwrap();
    let before = l.forest.read().unwrap().len();
    let mut new_k = rows(H * S, 77);
    let mut new_v = new_k.clone();
    let flush = Flush { keys: buf(&mut new_k), values: buf(&mut new_v), tokens: S };
    let o = worker.run(leader_job(&mut l, &mut q, &mut staging, Some(flush), width)).unwrap();
    let f = l.forest.read().unwrap();
    assert_eq!(f.len(), before + S);
    f.validate().unwrap();
    drop(f);
    // Every changed page that stays selected is reloaded; the rest are cleared.
    let m = meta(&o, &staging, 40);
    check_rows(&l, &o, &m, &staging);
    assert!(o.loads + o.clears > 0, "an insert changes at least one page per head");
    assert!(m.clear_bh.iter().all(|&bh| (bh as usize) < H));
}

#[test]
fn submit_waits_for_the_flag() {
    let mut a = layer(400, 120, 24);
    let mut b = layer(400, 120, 24);
    let worker = LookAhead::new(Some(2)).unwrap();
    let width = 12;
    let g = geometry();
    let (mut qa, mut qb) = (rows(H * G, 9), rows(H * G, 9));
    let (mut sa, mut sb) = (vec![0u8; staging_bytes(&g, 1, width, 24)], vec![0u8; staging_bytes(&g, 1, width, 24)]);
    let want = worker.run(leader_job(&mut a, &mut qa, &mut sa, None, width)).unwrap();
    let mut flag = vec![0i64; 1];
    let mut job = leader_job(&mut b, &mut qb, &mut sb, None, width);
    job.ready = Some(Ready { flag: buf(&mut flag), step: 3 });
    let state = worker.submit(job).unwrap();
    std::thread::sleep(Duration::from_millis(30));
    assert!(!state.is_done(), "the job must not start before its flag");
    let flag_addr = flag.as_mut_ptr() as usize;
    std::thread::spawn(move || {
        // SAFETY: the test waits for the job before `flag` is dropped.
        unsafe { std::ptr::write_volatile(flag_addr as *mut i64, 3) };
    })
    .join()
    .unwrap();
    let got = state.wait().unwrap();
    assert_eq!((got.loads, got.selected), (want.loads, want.selected));
    assert_eq!(sa[..want.end], sb[..got.end]);
    assert!(got.wait_s >= 0.02);
}

#[test]
fn cancel_finishes_waiting_jobs_with_an_error() {
    let mut l = layer(200, 80, 16);
    let worker = LookAhead::new(Some(1)).unwrap();
    let mut q = rows(H * G, 1);
    let mut staging = vec![0u8; staging_bytes(&geometry(), 1, 8, 16)];
    let mut flag = vec![0i64; 1];
    let mut job = leader_job(&mut l, &mut q, &mut staging, None, 8);
    job.ready = Some(Ready { flag: buf(&mut flag), step: 1 });
    let state = worker.submit(job).unwrap();
    worker.cancel();
    let err = state.wait().unwrap_err().to_string();
    assert!(err.contains("cancelled"), "{err}");
    // The worker still runs later jobs.
    let o = worker.run(leader_job(&mut l, &mut q, &mut staging, None, 8)).unwrap();
    assert!(o.selected > 0);
}

#[test]
fn follower_rewrites_changed_pages_and_stages_the_leaders_plan() {
    let n = 300;
    let mut l = layer(n, 200, 40);
    let worker = LookAhead::new(Some(2)).unwrap();
    let g = geometry();
    let width = 40;
    // A follower whose own keys equal the leader's: its store must end up equal.
    let cap = n + 64;
    let mut hk = vec![0f32; H * cap * D];
    for h in 0..H {
        hk[h * cap * D..(h * cap + n) * D].copy_from_slice(&l.keys[h * n * D..(h + 1) * n * D]);
    }
    let mut hv = hk.clone();
    let mut fk = l.k_store.clone();
    let mut fv = l.v_store.clone();
    let mut q = rows(H * G, 4);
    let mut new_k = rows(H * S, 77);
    let mut new_v = new_k.clone();
    let (mut fnk, mut fnv) = (new_k.clone(), new_v.clone());
    let mut ls = vec![0u8; staging_bytes(&g, 1, width, 40)];
    let mut fs = vec![0u8; staging_bytes(&g, 1, width, 40)];
    let lead_flush = Flush { keys: buf(&mut new_k), values: buf(&mut new_v), tokens: S };
    let lead = worker.submit(leader_job(&mut l, &mut q, &mut ls, Some(lead_flush), width)).unwrap();
    let lane = FollowerLane {
        k_store: buf(&mut fk),
        v_store: buf(&mut fv),
        k_history: buf(&mut hk),
        v_history: buf(&mut hv),
        history_len: n + S,
        flush: Some(Flush { keys: buf(&mut fnk), values: buf(&mut fnv), tokens: S }),
    };
    let fo = worker.submit(follower_job(g, &mut fs, lane, &lead)).unwrap().wait().unwrap();
    let lo = lead.wait().unwrap();
    assert_eq!(fk, l.k_store, "follower store differs from the leader's after the insert");
    assert_eq!(fv, l.v_store);
    assert_eq!((fo.loads, fo.clears, fo.width), (lo.loads, lo.clears, lo.width));
    assert_eq!(fs[..fo.end], ls[..lo.end], "same keys, same plan: same staging");
}

#[test]
fn bad_jobs_fail_at_submit() {
    let mut l = layer(100, 40, 8);
    let worker = LookAhead::new(Some(1)).unwrap();
    let mut q = rows(H * G - 1, 1); // one query head short
    let mut staging = vec![0u8; 64];
    assert!(worker.submit(leader_job(&mut l, &mut q, &mut staging, None, 4)).is_err());
    let mut q = rows(H * G, 1);
    // Too small a staging buffer fails when the job runs, not by writing past it.
    let err = worker.run(leader_job(&mut l, &mut q, &mut staging, None, 4)).unwrap_err().to_string();
    assert!(err.contains("staging"), "{err}");
}

/// Quantised pages: the leader's job inserts (quantising, splits keep codes), a follower with
/// the same keys rewrites its changed pages from its history to the same bytes, and both stage
/// the store's pages (codes and scales) of their plan: int8 K and V, or int8 K and 4-bit V.
#[test]
fn quantised_leader_and_follower_stage_store_pages() {
    for format in [PageFormat::Int8, PageFormat::K8V4] {
        quantised_staging(format);
    }
}

fn quantised_staging(format: PageFormat) {
    let n = 300;
    let g = Geometry { format, ..geometry() };
    let (kb, vb) = (int8::page_bytes(S, D), g.v_page_bytes());
    assert_eq!(g.k_page_bytes(), kb);
    let keys = rows(H * n, 1);
    let mut cfg = Config::new(D, Metric::InnerProduct);
    cfg.seed = Some(5);
    cfg.promotion = vec![0.05, 0.2];
    let f = HeadForest::build(KeyData::F32(&keys), H, cfg, S, format).unwrap();
    let p = 200;
    let (mut ks, mut vs) = (vec![0u8; H * p * kb], vec![0u8; H * p * vb]);
    let stores = match format {
        PageFormat::Int8 => Stores::Int8(&mut ks, &mut vs),
        _ => Stores::K8V4(&mut ks, &mut vs),
    };
    f.write_pages(&keys, &keys, stores).unwrap();
    let forest = Arc::new(RwLock::new(f));
    let resident = Arc::new(RwLock::new(ResidentPages::new(H, 40).unwrap()));
    let cap = n + 64;
    let mut hk = vec![0f32; H * cap * D];
    for h in 0..H {
        hk[h * cap * D..(h * cap + n) * D].copy_from_slice(&keys[h * n * D..(h + 1) * n * D]);
    }
    let mut hv = hk.clone();
    let (mut fk, mut fv) = (ks.clone(), vs.clone());
    let worker = LookAhead::new(Some(2)).unwrap();
    let width = 40;
    let mut q = rows(H * G, 4);
    let mut new_k = rows(H * S, 77);
    let mut new_v = new_k.clone();
    let (mut fnk, mut fnv) = (new_k.clone(), new_v.clone());
    let bytes = g.staging_layout(1, width, 40).bytes;
    let (mut ls, mut fs) = (vec![0u8; bytes], vec![0u8; bytes]);
    let lead = worker
        .submit(Job {
            geometry: g,
            ready: None,
            staging: buf(&mut ls),
            work: Work::Leader {
                lanes: vec![LeaderLane {
                    forest: Some(forest.clone()),
                    resident: resident.clone(),
                    k_store: buf(&mut ks),
                    v_store: buf(&mut vs),
                    flush: Some(Flush { keys: buf(&mut new_k), values: buf(&mut new_v), tokens: S }),
                }],
                queries: buf(&mut q),
                select: SelectParams {
                    max_pages: width,
                    scale: 0.25,
                    effort: Some(1.0),
                    exact: false,
                    successors: 0,
                    group_view: false,
                },
                reselect: true,
            },
            keep_alive: Box::new(()),
        })
        .unwrap();
    let lane = FollowerLane {
        k_store: buf(&mut fk),
        v_store: buf(&mut fv),
        k_history: buf(&mut hk),
        v_history: buf(&mut hv),
        history_len: n + S,
        flush: Some(Flush { keys: buf(&mut fnk), values: buf(&mut fnv), tokens: S }),
    };
    let fo = worker.submit(follower_job(g, &mut fs, lane, &lead)).unwrap().wait().unwrap();
    let lo = lead.wait().unwrap();
    assert!(lo.loads > 0);
    assert_eq!(lo.end, g.staging_layout(1, width, 40).rows_at + lo.loads * (kb + vb));
    assert!(fk == ks && fv == vs, "the follower's {format:?} pages differ from the leader's");
    assert_eq!(fs[..fo.end], ls[..lo.end], "same keys, same plan: same staging");
    // Each staged row is a K page of the store and the V page at the same place, and both
    // dequantise near the tokens' keys (the values equal the keys here).
    let f = forest.read().unwrap();
    let all = [&keys[..], &rows(H * S, 77)[..]];
    let key_of = |h: usize, t: usize| -> &[f32] {
        if t < n {
            &all[0][(h * n + t) * D..(h * n + t + 1) * D]
        } else {
            &all[1][(h * S + t - n) * D..(h * S + t - n + 1) * D]
        }
    };
    let rows_at = g.staging_layout(1, width, 40).rows_at;
    for i in 0..lo.loads {
        let row = &ls[rows_at + i * (kb + vb)..rows_at + (i + 1) * (kb + vb)];
        let (staged_k, staged_v) = row.split_at(kb);
        let (head, page) = (0..H)
            .flat_map(|h| (0..f.num_pages(h).unwrap()).map(move |pg| (h, pg)))
            .find(|&(h, pg)| &ks[(h * p + pg) * kb..(h * p + pg + 1) * kb] == staged_k)
            .expect("a staged K page is a page of the store");
        assert_eq!(staged_v, &vs[(head * p + page) * vb..(head * p + page + 1) * vb], "V page of the same place");
        for (slot, &t) in f.page_tokens(head, page).unwrap().iter().enumerate() {
            let key = key_of(head, t as usize);
            let (codes, scale) = int8::row_parts(staged_k, slot, S, D);
            let mut back = vec![0f32; D];
            int8::dequantize_row(codes, scale, &mut back);
            for (x, y) in key.iter().zip(&back) {
                assert!((x - y).abs() <= scale * 0.5001, "token {t}: {x} vs {y} (scale {scale})");
            }
            if format == PageFormat::K8V4 {
                value4::get_row(staged_v, slot, S, &mut back);
                // 15 steps span each group of 32 values; a code is off by at most half a step.
                for (c, (x, y)) in key.chunks(value4::GROUP).zip(back.chunks(value4::GROUP)).flat_map(|(kc, bc)| {
                    let span =
                        kc.iter().cloned().fold(f32::MIN, f32::max) - kc.iter().cloned().fold(f32::MAX, f32::min);
                    kc.iter().zip(bc).map(move |p| (span, p))
                }) {
                    assert!((x - y).abs() <= c / 15.0 * 0.5 + 0.02 * c + 1e-6, "token {t}: {x} vs {y} (span {c})");
                }
            }
        }
    }
}

/// The buffers of one `LayerJobs` (one sequence), owned by the test; `jobs` borrows them.
struct LayerBufs {
    q: Vec<f32>,
    flag: Vec<i64>,
    flush_k: Vec<f32>,
    flush_v: Vec<f32>,
    staging: Vec<u8>,
}

impl LayerBufs {
    fn new(width: usize, capacity: usize) -> LayerBufs {
        LayerBufs {
            q: rows(H * G, 4),
            // Queued jobs may start at once.
            flag: vec![i64::MAX],
            flush_k: vec![0.0; H * S * D],
            flush_v: vec![0.0; H * S * D],
            staging: vec![0; geometry().staging_layout(1, width, capacity).bytes],
        }
    }

    fn lend(&mut self) -> LayerBuffers {
        LayerBuffers {
            queries: buf(&mut self.q),
            flag: buf(&mut self.flag),
            flush_k: buf(&mut self.flush_k),
            flush_v: buf(&mut self.flush_v),
            staging: buf(&mut self.staging),
            keep_alive: Arc::new(()),
        }
    }
}

fn params(width: usize) -> SelectParams {
    SelectParams { max_pages: width, scale: 0.25, effort: Some(1.0), exact: false, successors: 0, group_view: false }
}

fn leading_lane(l: &mut Layer) -> Lane {
    Lane {
        k_store: buf(&mut l.k_store),
        v_store: buf(&mut l.v_store),
        source: LaneSource::Index { forest: Some(l.forest.clone()), resident: l.resident.clone() },
        keep_alive: Arc::new(()),
    }
}

/// A following layer's `n`th job pairs with its leader's `n`th, even when the leader has
/// started its next one; one the leader has not started (or has forgotten) is an error.
#[test]
fn layer_jobs_pair_a_follower_with_the_leaders_job_of_its_number() {
    let (n, width, capacity) = (400, 6, 24);
    let mut l = layer(n, 120, capacity);
    let worker = Arc::new(LookAhead::new(Some(2)).unwrap());
    let mut lb = LayerBufs::new(width, capacity);
    let lead = Arc::new(LayerJobs::new(worker.clone(), geometry(), 1, params(width), 1, lb.lend(), None).unwrap());
    let mut fb = LayerBufs::new(width, capacity);
    let follow = LayerJobs::new(worker, geometry(), 1, params(width), 1, fb.lend(), Some(lead.clone())).unwrap();
    let (mut fk, mut fv) = (l.k_store.clone(), l.v_store.clone());
    let mut hk = l.keys.clone();
    let mut hv = l.keys.clone();
    let follower_lane = Lane {
        k_store: buf(&mut fk),
        v_store: buf(&mut fv),
        source: LaneSource::History { k_history: buf(&mut hk), v_history: buf(&mut hv) },
        keep_alive: Arc::new(()),
    };
    lead.set_lane(0, leading_lane(&mut l)).unwrap();
    follow.set_lane(0, follower_lane).unwrap();
    let err = follow.start(&[0], None, Some(&[n])).unwrap_err();
    assert!(matches!(err, icecache::Error::Order(_)), "{err}");
    // Four leader jobs with different queries: each selects differently.
    let mut selected = Vec::new();
    for seed in 0..4 {
        lb.q.copy_from_slice(&rows(H * G, 100 + seed));
        lead.start(&[0], None, None).unwrap();
        selected.push(lead.current().unwrap().wait().unwrap().selected_pages());
    }
    assert!(selected.windows(2).all(|w| w[0] != w[1]), "the test needs selections that differ");
    // Jobs 0 and 1 are forgotten (the leader keeps its last two): too far behind.
    let err = follow.start(&[0], None, Some(&[n])).unwrap_err();
    assert!(matches!(err, icecache::Error::Order(_)), "{err}");
    follow.clear();
    lead.clear();
    lead.set_lane(0, leading_lane(&mut l)).unwrap();
    let follower_lane = Lane {
        k_store: buf(&mut fk),
        v_store: buf(&mut fv),
        source: LaneSource::History { k_history: buf(&mut hk), v_history: buf(&mut hv) },
        keep_alive: Arc::new(()),
    };
    follow.set_lane(0, follower_lane).unwrap();
    let mut lead_selected = Vec::new();
    for seed in 0..2 {
        lb.q.copy_from_slice(&rows(H * G, 200 + seed));
        lead.start(&[0], None, None).unwrap();
        lead_selected.push(lead.current().unwrap().wait().unwrap().selected_pages());
    }
    // The leader is one job ahead of each: the follower's job k pairs with the leader's job k.
    for want in &lead_selected {
        follow.start(&[0], None, Some(&[n])).unwrap();
        assert_eq!(&follow.current().unwrap().wait().unwrap().selected_pages(), want);
    }
    assert_ne!(lead_selected[0], lead_selected[1]);
}

/// Queued jobs select anew every `refresh`th job (or when tokens were flushed); jobs run now
/// always select.
#[test]
fn layer_jobs_reselect_every_refresh_jobs() {
    let (width, capacity, refresh) = (6, 24, 3);
    let mut l = layer(400, 120, capacity);
    let worker = Arc::new(LookAhead::new(Some(2)).unwrap());
    let mut lb = LayerBufs::new(width, capacity);
    let jobs = LayerJobs::new(worker, geometry(), 1, params(width), refresh, lb.lend(), None).unwrap();
    jobs.set_lane(0, leading_lane(&mut l)).unwrap();
    let mut selects = Vec::new();
    for number in 0..7 {
        jobs.start(&[0], Some(number), None).unwrap();
        selects.push(jobs.current().unwrap().wait().unwrap().selected > 0);
    }
    assert_eq!(selects, [true, false, false, true, false, false, true]);
    jobs.start(&[0], None, None).unwrap(); // job 7, run now
    assert!(jobs.current().unwrap().wait().unwrap().selected > 0);
    // A flush makes a queued job select: job 8 would not.
    lb.flush_k.copy_from_slice(&rows(H * S, 31));
    lb.flush_v.copy_from_slice(&lb.flush_k.clone());
    jobs.start(&[S], Some(8), None).unwrap();
    assert!(jobs.current().unwrap().wait().unwrap().selected > 0);
    jobs.start(&[0], Some(9), None).unwrap();
    assert!(jobs.current().unwrap().wait().unwrap().selected > 0, "job 9 is a refresh");
    jobs.start(&[0], Some(10), None).unwrap();
    assert_eq!(jobs.current().unwrap().wait().unwrap().selected, 0);
}

/// A lane must fit its layer: its role, and its forest's shape and page format.
#[test]
fn layer_jobs_check_their_lanes() {
    let (width, capacity) = (6, 24);
    let mut l = layer(400, 120, capacity);
    let worker = Arc::new(LookAhead::new(Some(1)).unwrap());
    let mut lb = LayerBufs::new(width, capacity);
    let g = Geometry { format: PageFormat::Int8, ..geometry() };
    let int8 = LayerJobs::new(worker.clone(), g, 1, params(width), 1, lb.lend(), None).unwrap();
    let err = int8.set_lane(0, leading_lane(&mut l)).unwrap_err().to_string();
    assert!(err.contains("page format"), "{err}");
    let jobs = LayerJobs::new(worker, geometry(), 1, params(width), 1, lb.lend(), None).unwrap();
    assert!(jobs.set_lane(1, leading_lane(&mut l)).is_err(), "b outside the batch");
    let (mut hk, mut hv) = (l.keys.clone(), l.keys.clone());
    let history = Lane {
        k_store: buf(&mut l.k_store),
        v_store: buf(&mut l.v_store),
        source: LaneSource::History { k_history: buf(&mut hk), v_history: buf(&mut hv) },
        keep_alive: Arc::new(()),
    };
    assert!(jobs.set_lane(0, history).is_err(), "a leading layer's lane needs an index");
    let err = jobs.start(&[0], None, None).unwrap_err().to_string();
    assert!(err.contains("set_lane"), "{err}");
    jobs.set_lane(0, leading_lane(&mut l)).unwrap();
    assert!(jobs.start(&[S + 1], None, None).is_err(), "more than a page flushed");
    jobs.start(&[0], None, None).unwrap();
    assert!(jobs.done());
}
